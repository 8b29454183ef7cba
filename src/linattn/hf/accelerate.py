"""`accelerate(model)`: a transformers causal LM as a LinattnForCausalLM that computes the same thing
on linattn's model (docs/design.md §22).

    import linattn.hf
    fast = linattn.hf.accelerate(AutoModelForCausalLM.from_pretrained(path))
    fast.generate(ids, max_new_tokens=64)            # greedy, sampling, beam search, streamers, left padding
    pipeline("text-generation", model=fast, tokenizer=tokenizer)

The model is converted by linattn.hf.hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid),
linattn.hf.kimi (Kimi Linear) or
linattn.hf.teacher (Llama, Mistral, Qwen2, Qwen3, GPT-2): the same logits up to float rounding, so generation gives the same tokens as
transformers' own path wherever no two logits tie within that rounding. Its generation_config
(eos, pad, bos ids, sampling defaults) and its config's special token ids are carried over. Model
types not converted yet are refused by name.
"""

from __future__ import annotations

import copy

from torch import nn

from .hybrid import HYBRID_SUPPORTED, from_transformers_hybrid, text_config
from .kimi import KIMI_SUPPORTED, from_transformers_kimi
from .modeling import LinattnForCausalLM
from .teacher import SUPPORTED as SOFTMAX_SUPPORTED, from_transformers

__all__ = ["CONVERTED", "NOT_YET", "accelerate"]

#: transformers' linear-attention hybrids linattn does not convert yet, and what they lack (design §22); none now
NOT_YET: dict[str, str] = {}
#: every model_type accelerate converts
CONVERTED = (*HYBRID_SUPPORTED, *KIMI_SUPPORTED, *SOFTMAX_SUPPORTED)


def accelerate(model: nn.Module, *, share: bool = True) -> LinattnForCausalLM:
    """A LinattnForCausalLM equal to transformers' causal LM `model` (module docstring), in its dtype.
    share (hybrids): the Parameters whose layout agrees are `model`'s own, not copies
    (linattn.hf.hybrid, linattn.hf.kimi)."""
    config = getattr(model, "config", None)
    mt = getattr(config, "model_type", None)
    if mt in HYBRID_SUPPORTED:
        lm = from_transformers_hybrid(model, share=share)
    elif mt in KIMI_SUPPORTED:
        lm = from_transformers_kimi(model, share=share)
    elif mt in SOFTMAX_SUPPORTED:
        lm = from_transformers(model)
    elif mt in NOT_YET:
        raise ValueError(f"model_type {mt!r}: {mt} is not converted yet: {NOT_YET[mt]} (linattn.hf.accelerate "
                         f"converts {', '.join(CONVERTED)})")
    else:
        raise ValueError(f"model_type {mt!r}: linattn.hf.accelerate converts "
                         f"{', '.join(CONVERTED)} causal LMs")
    c = text_config(config)
    ids = {name: getattr(c, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    hf = LinattnForCausalLM.from_linattn(lm, **ids)
    if getattr(model, "generation_config", None) is not None:
        hf.generation_config = copy.deepcopy(model.generation_config)
    return hf
