"""Every operator family's public entry points (issue 32; replaces the test that a kind's name is spelled
in at most three source files): each record of linattn.nn.families runs the operators linattn.ops
exports — full (and packed: the same function with cu_seqlens), step — and the sharded form
linattn.parallel exports, makes its family's cache (new_state), and every kind's row names its
layer's record. A kind added on an existing family (design §10.1) is then covered by this table."""

from __future__ import annotations

import pytest
import torch

from linattn import ops, parallel
from linattn.models import KINDS, LinearTransformerLM, ModelConfig
from linattn.models.kinds import FAMILIES
from linattn.nn import families
from linattn.nn.caches import (
    KVCache,
    LayerCache,
    LigerCache,
    LinearAttentionCache,
    LoLCATsCache,
    RecurrentCache,
    SlidingWindowCache,
)

#: (record name in linattn.nn.families, its module, the operators of linattn.ops it runs (full/packed,
#: step), the sharded form of linattn.parallel or None (refused by name), the cache of new_state)
EXPORTS = [
    ("LINEAR", families.linear, ("linear_attention", "linear_attention_step"), "sequence_parallel_linear_attention",
     LinearAttentionCache),
    ("GATED", families.gated, ("gated_linear_attention", "gated_linear_attention_step"),
     "sequence_parallel_gated_linear_attention", RecurrentCache),
    ("DELTA", families.delta, ("delta_rule", "delta_rule_step"), "sequence_parallel_delta_rule", RecurrentCache),
    ("SOFTMAX", families.softmax, ("softmax_attention",), "sequence_parallel_softmax_attention", KVCache),
    ("WINDOW", families.window, ("sliding_window_attention", "sliding_window_attention_step"), None,
     SlidingWindowCache),
    ("WINDOW_LINEAR", families.window, ("lolcats_attention", "lolcats_attention_step"), None, LoLCATsCache),
    ("WINDOW_GATED", families.window, (), None, LigerCache),  # the mean of WINDOW's and GATED's
]
RECORDS = {name: getattr(families, name) for name, *_ in EXPORTS}


@pytest.mark.parametrize("name, module, operators, sharded, cache", EXPORTS, ids=[e[0] for e in EXPORTS])
def test_a_family_record_runs_the_exported_operators(name, module, operators, sharded, cache):
    record = getattr(families, name)
    assert name in families.__all__ and record.name in FAMILIES
    for op in operators:
        assert op in ops.__all__, f"linattn.ops does not export {op}"
        assert getattr(module, op) is getattr(ops, op), f"{module.__name__} runs another {op} than linattn.ops's"
    assert callable(record.full) and callable(record.packed) and callable(record.step)
    if sharded is None:
        assert record.sequence_parallel is None
    else:
        assert sharded in parallel.__all__ and getattr(module, sharded) is getattr(parallel, sharded)
        assert callable(record.sequence_parallel)
    state = record.new_state()
    assert isinstance(state, cache) and isinstance(state, LayerCache)


def test_the_per_channel_delta_names_are_the_delta_familys():
    """KDA is the delta family with one gate per key channel: its names in linattn.ops and
    linattn.parallel are entry points of delta_rule / delta_rule_step (the same numbers)."""
    assert {"kda", "kda_step"} <= set(ops.__all__) and "sequence_parallel_kda" in parallel.__all__
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64), torch.randn(2, 2, 5, 4, generator=g,
                                                                                  dtype=torch.float64)
    v = torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64)
    beta = torch.rand(2, 2, 5, generator=g, dtype=torch.float64)
    gate = -torch.rand(2, 2, 5, 4, generator=g, dtype=torch.float64)
    o, S = ops.kda(q, k, v, beta, gate, return_state=True)
    o2, S2 = ops.delta_rule(q, k, v, beta, g=gate, return_state=True)
    assert torch.equal(o, o2) and torch.equal(S, S2)
    o, S = ops.kda_step(S, q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], gate[:, :, :1])
    o2, S2 = ops.delta_rule_step(S2, q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], g=gate[:, :, :1])
    assert torch.equal(o, o2) and torch.equal(S, S2)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kinds_row_names_its_family_record(kind):
    row = KINDS[kind]
    record = row.layer.family
    assert any(record is r for r in RECORDS.values()), f"{kind}: its layer's family is no record of the table"
    assert row.family == record.name
    model = LinearTransformerLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, attention=[kind]))
    attn = model.blocks[0].attn
    assert attn.family is record and isinstance(attn.new_cache(), type(record.new_state()))
