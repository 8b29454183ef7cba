"""Autoregressive generation with per-layer caches (design §8).

    prefill:  logits, cache = model(prompt (B, N), mask, cache=model.new_cache(), last_only=True)
              (chunked parallel path; returns the (kv, z) state of every linear layer and the K/V
              of every softmax layer)
    step t:   logits, cache = model(token_t (B, 1), cache=cache, last_only=True)
              O(1) per linear layer, O(context) per softmax layer.

The run is a linattn.models.session.DecodingSession: the steps run fused by default
(linattn.models.decoding.FusedDecoder: the whole model's step in one C++ call, reading each weight
once) where the model allows it (fused_decoding_obstacle), the eager step otherwise; `fused=False`
forces the eager step, the reference the fused one equals up to the order of float sums,
`fused=True` requires the fused one.

Prompts of different lengths are left-padded; the key-padding mask removes the pads from every
numerator and denominator and positions count from each prompt's first real token, so each row
produces the tokens it would produce alone. Sampling uses one torch.Generator per row, all seeded
with `seed`, so a prompt samples the same tokens in a batch as alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import torch

from .._checks import check_int, check_number, check_positive_int
from .kinds import kind_of
from .session import DecodingSession

#: the kinds without a fused mixer that generation has already said it decodes eagerly
_EAGER_KINDS_SAID: set = set()


def prepare_prompts(prompt_ids, mask: torch.Tensor | None = None, pad_id: int = 0, device=None):
    """Prompts -> (ids (B, N) long, mask (B, N) bool or None), left-padded.

    prompt_ids: a list of ints or 1-D tensor (one prompt), a 2-D tensor (B, N) (with an optional
    left-padding `mask`), or a list of prompts (lists / 1-D tensors) of any lengths ≥ 1.
    """
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.dim() != 2 or prompt_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"prompt_ids tensor must be integer (N,) or (B, N), got {tuple(prompt_ids.shape)} {prompt_ids.dtype}")
        ids = prompt_ids.long().to(device) if device is not None else prompt_ids.long()
        if ids.shape[1] == 0:
            raise ValueError("prompt_ids must hold at least one token per prompt")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != ids.shape:
                raise ValueError(f"mask must be a bool tensor of prompt_ids' shape {tuple(ids.shape)}")
            mask = mask.to(ids.device)
            if not bool(mask[:, -1].all()):
                raise ValueError("mask: prompts must be left-padded (the last token of every row real)")
            if bool(mask.all()):
                mask = None
        return ids, mask
    if mask is not None:
        raise ValueError("mask is only taken with a 2-D prompt_ids tensor")
    if not isinstance(prompt_ids, Sequence) or len(prompt_ids) == 0:
        raise ValueError(f"prompt_ids must be a non-empty list or a tensor, got {prompt_ids!r}")
    if all(isinstance(t, int) for t in prompt_ids):
        prompt_ids = [prompt_ids]
    rows = [list(p.tolist()) if isinstance(p, torch.Tensor) else list(p) for p in prompt_ids]
    for i, r in enumerate(rows):
        if not r or not all(isinstance(t, int) for t in r):
            raise ValueError(f"prompt {i} must be a non-empty list of ints, got {r!r}")
    n = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (n - len(r)) + r for r in rows], dtype=torch.long, device=device)
    if all(len(r) == n for r in rows):
        return ids, None
    mask = torch.tensor([[False] * (n - len(r)) + [True] * len(r) for r in rows], device=device)
    return ids, mask


def _check_sampling(max_new_tokens, temperature, top_k, top_p):
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_number("temperature (0 = greedy)", temperature, minimum=0)  # NaN and inf refused
    check_positive_int("top_k", top_k, allow_none=True)
    check_number("top_p", top_p, minimum=0, low_open=True, maximum=1, allow_none=True)


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """logits (B, V) -> logits with −∞ outside the top-k and outside the nucleus: the smallest set of
    most likely tokens whose probability reaches top_p (the most likely token is always kept)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # probability mass strictly ahead of each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """Next tokens (B,) long from logits (B, V): argmax when temperature == 0, otherwise a draw from
    softmax(filter(logits / temperature)) with row i's generator.

    The division runs on logits − max(logits) in float64, so any temperature > 0 works, down to
    5e-324 (the shifted logits are ≤ 0: a tiny temperature sends all but the largest to −∞, i.e.
    greedy, instead of overflowing to inf − inf = NaN). Logits holding NaN or +inf (a diverged
    model) raise ValueError naming the row: neither greedy nor sampling can pick from them."""
    logits = logits.float()
    bad = torch.isnan(logits) | (logits == float("inf"))
    if bool(bad.any()):
        row = int(bad.any(-1).nonzero()[0, 0])
        raise ValueError(f"the model's logits hold NaN or +inf (row {row} of {logits.shape[0]}): no token can be "
                         "chosen from them; the model or its checkpoint is broken (diverged weights?)")
    if temperature == 0:
        return logits.argmax(-1)
    shifted = logits.double() - logits.amax(-1, keepdim=True).double()  # ≤ 0, 0 at the most likely token
    probs = torch.softmax(filter_logits(shifted / temperature, top_k, top_p), dim=-1)
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


def stream(model, prompt_ids, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, seed: int | None = None, stop_tokens=None,
           mask: torch.Tensor | None = None, fused: bool | None = None) -> Iterator[list[int | None]]:
    """Yields one list per step with, for each prompt, the new token id, or None once that prompt
    has produced a stop token (the stop token itself is yielded). Ends after max_new_tokens steps
    or when every prompt has stopped. The model runs in eval mode, without gradients, and is put
    back in its previous mode when the iterator ends or is closed. fused: None (default) runs the
    steps through linattn.models.decoding.FusedDecoder where the model allows it, True requires it (a
    ValueError says why not), False runs the eager step."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    session = DecodingSession(model, fused=fused)  # fused=True: a ValueError says why it cannot be
    if fused is not False:
        _say_eager_kinds(model)
    device = next(model.parameters()).device
    ids, mask = prepare_prompts(prompt_ids, mask, device=device)
    stops = set() if stop_tokens is None else ({stop_tokens} if isinstance(stop_tokens, int) else set(stop_tokens))
    limit = model.config.max_positions
    longest = int(ids.shape[1] if mask is None else mask.sum(1).max())
    if limit is not None and longest + max_new_tokens - 1 > limit:
        raise ValueError(f"max_new_tokens={max_new_tokens} with a prompt of {longest} tokens needs "
                         f"{longest + max_new_tokens - 1} positions; this model takes {limit}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    return _steps(session, ids, mask, max_new_tokens, temperature, top_k, top_p, seed, stops)


def _say_eager_kinds(model) -> None:
    """Warns once per kind when the model holds layers of a kind without a fused mixer (Kind.fused
    None): their models generate through the eager step."""
    blocks = getattr(model, "blocks", ())
    kinds = {k.name for k in (kind_of(getattr(b, "attn", None)) for b in blocks) if k is not None and k.fused is None}
    new = sorted(kinds - _EAGER_KINDS_SAID)
    if new:
        _EAGER_KINDS_SAID.update(new)
        warnings.warn(f"generation takes the eager step: the kind(s) {', '.join(new)} have no fused decoding mixer",
                      stacklevel=3)


def _steps(session, ids, mask, max_new_tokens, temperature, top_k, top_p, seed, stops):
    if max_new_tokens == 0:
        return
    model = session.model
    gens = [torch.Generator(device=ids.device).manual_seed(seed) for _ in range(ids.shape[0])]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = session.forward(ids, mask)[:, -1]
        session.reserve(max_new_tokens)
        done = [False] * ids.shape[0]
        for step in range(max_new_tokens):
            with torch.no_grad():
                tok = sample_next(logits, temperature, top_k, top_p, gens)
            out = []
            for i, t in enumerate(tok.tolist()):
                out.append(None if done[i] else t)
                done[i] = done[i] or t in stops
            yield out
            if all(done) or step == max_new_tokens - 1:
                break
            with torch.no_grad():
                logits = session.step(tok)
    finally:
        model.train(was_training)


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_tokens=None,
             mask: torch.Tensor | None = None, fused: bool | None = None) -> list[list[int]]:
    """The new tokens of every prompt (list of lists, stop token included when one is hit).

    prompt_ids: one prompt (list of ints / 1-D tensor), a list of prompts of any lengths, or a
    (B, N) tensor with an optional left-padding mask. temperature 0 is greedy; top_k / top_p
    filter before sampling; seed makes sampling reproducible (per prompt, see module doc). fused:
    see `stream`.
    """
    outs: list[list[int]] | None = None
    for step in stream(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=seed, stop_tokens=stop_tokens, mask=mask, fused=fused):
        if outs is None:
            outs = [[] for _ in step]
        for row, t in zip(outs, step):
            if t is not None:
                row.append(t)
    if outs is None:  # max_new_tokens == 0
        n = prepare_prompts(prompt_ids, mask)[0].shape[0]
        outs = [[] for _ in range(n)]
    return outs


__all__ = ["filter_logits", "generate", "prepare_prompts", "sample_next", "stream"]
