"""linattn inside Hugging Face transformers (optional extra: `pip install linattn[hf]`).

Importing this package registers model_type "linattn" with transformers' Auto classes:

    import linattn.hf                                    # registers LinattnConfig / LinattnForCausalLM
    hf = linattn.hf.LinattnForCausalLM.from_linattn(lm)  # a LinearTransformerLM as a transformers model
    hf.save_pretrained(d); AutoModelForCausalLM.from_pretrained(d)  # no remote code needed

and ships the byte-level tokenizer of `linattn train`'s byte LM (ByteTokenizer). The other
direction, transformers' Qwen3.5 / Qwen3-Next / OLMo-Hybrid / Kimi Linear on linattn's kernels:

    patch = linattn.hf.use_linattn_kernels()   # ... patch.undo() (linattn.hf.kernels)

or a transformers causal LM (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid, Kimi Linear; Llama, Mistral,
Qwen2, Qwen3, GPT-2) converted into linattn's model, the same logits, driven by generate and pipelines as
before (linattn.hf.accelerate):

    fast = linattn.hf.accelerate(model)
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .accelerate import accelerate
from .cache import LinattnCache
from .config import LinattnConfig
from .kernels import KernelPatch, KernelPatchError, undo_linattn_kernels, use_linattn_kernels
from .modeling import LinattnForCausalLM, LinattnPreTrainedModel
from .tokenizer import ByteTokenizer


def _register() -> None:
    AutoConfig.register(LinattnConfig.model_type, LinattnConfig, exist_ok=True)
    AutoModelForCausalLM.register(LinattnConfig, LinattnForCausalLM, exist_ok=True)
    AutoTokenizer.register(LinattnConfig, tokenizer_class=ByteTokenizer, exist_ok=True)


_register()

__all__ = [
    "ByteTokenizer",
    "KernelPatch",
    "KernelPatchError",
    "LinattnCache",
    "LinattnConfig",
    "LinattnForCausalLM",
    "LinattnPreTrainedModel",
    "accelerate",
    "undo_linattn_kernels",
    "use_linattn_kernels",
]
