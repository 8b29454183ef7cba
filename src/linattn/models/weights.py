"""The weight matrices the fused decoder reads (linattn.models.decoding, csrc/matvec.h): float (fp32,
bf16) tensors, or 8-bit quantized ones (torchao: weight-only, or with dynamically quantized activations).

int8 weight-only quantization is what `torchao.quantization.quantize_(model, Int8WeightOnlyConfig())`
(and transformers' `TorchAoConfig("int8_weight_only")`) does to every nn.Linear of a model: its weight
becomes a torchao Int8Tensor holding

    qdata (N, K) int8   the weights' integers, W[j, i] ≈ s_j · q[j, i]; row-major, or the transpose of
                        a row-major (K, N) tensor for linattn's column-major Linears (nn.base.column_major)
    scale (N, 1) float32 one scale per output row (PerRow granularity, block_size [1, K]),
          (1, 1)         or one for the matrix (PerTensor, block_size [N, K])
    zero_point          zeros (symmetric quantization)

and its F.linear (torchao's weight-only path) computes y = (x · qᵀ) · sᵀ (+ bias) in the activation's
dtype (a bf16 model rounds x · qᵀ to bf16, then the product with bf16(s)). The fused step reads qdata
and the scales in place (`plan_weight`) and computes the same y_j = s_j · Σ_i x_i q_ji with float
accumulation, so an int8 step streams a quarter of the fp32 step's bytes.

torchao's dynamic int8 quantization (`Int8DynamicActivationInt8WeightConfig`, transformers'
`TorchAoConfig("int8_dynamic_activation_int8_weight")`) holds the same int8 weights and also rounds
each activation row (or the whole activation) to int8 with a symmetric scale before an integer
product (act_quant_kwargs); the fused step does the same, with VNNI's integer dot products, in
float32 models (`activation_quantization`; csrc/matvec_dynamic.h gives the arithmetic).

What it does not read is refused (`quantization_obstacle`, naming the parameter): other torchao
tensors (int4, float8, ...), per-group scales (block_size [1, G], G < K), nonzero zero points,
asymmetric, reduced-range or static activation quantization, activation pre-scales, dynamic
quantization in a bf16 model, and quantized parameters of anything but an nn.Linear (e.g. an
embedding). Then generation runs the eager step,
which takes any of them through torchao's own operators.
"""

from __future__ import annotations

import torch
from torch import nn

_PLAIN = (torch.Tensor, nn.Parameter)


def is_quantized(t: torch.Tensor) -> bool:
    """True when `t` is a tensor subclass (torchao's quantized tensors), not a plain tensor."""
    return isinstance(t, torch.Tensor) and type(t) not in _PLAIN


def _int8_obstacle(w) -> str | None:
    """Why the fused step cannot read the quantized weight `w` in place (None: it can)."""
    kind = type(w).__name__
    if kind != "Int8Tensor" or not all(hasattr(w, a) for a in ("qdata", "scale", "block_size")):
        return f"is a {kind}; the fused step reads torchao's int8 weight-only tensors (Int8WeightOnlyConfig) only"
    q, s = w.qdata, w.scale
    if q.dtype != torch.int8 or q.dim() != 2:
        return f"holds {q.dtype} data of {q.dim()} dimensions; the fused step reads int8 matrices"
    n, k = q.shape
    if list(w.block_size) not in ([1, k], [n, k]):
        return (f"is quantized in blocks of {list(w.block_size)}; the fused step reads per-row ([1, {k}]) "
                f"or per-tensor scales, not per-group ones")
    if s.numel() not in (1, n):
        return f"has {s.numel()} scales for {n} rows"
    if getattr(w, "act_pre_scale", None) is not None:
        return "scales the activations before quantizing them (act_pre_scale); the fused step does not"
    act = getattr(w, "act_quant_kwargs", None)
    if act is not None:
        why = _activation_obstacle(w, act)
        if why is not None:
            return why
    zero = getattr(w, "zero_point", None)
    if zero is not None and bool(torch.any(zero != 0)):
        return "has nonzero zero points (asymmetric quantization); the fused step reads symmetric int8 weights"
    if not (q.is_contiguous() or q.t().is_contiguous()):
        return f"holds int8 data of strides {q.stride()}; the fused step reads a row-major matrix or its transpose"
    return None


def _activation_obstacle(w, act) -> str | None:
    """Why the fused step cannot quantize the activations of `w` as torchao does (None: it can)."""
    granularity = type(getattr(act, "granularity", None)).__name__
    if type(act).__name__ != "QuantizeTensorToInt8Kwargs" or granularity not in ("PerRow", "PerTensor") or \
            (granularity == "PerRow" and getattr(act.granularity, "dim", -1) != -1):
        return (f"quantizes its activations by {type(act).__name__} ({granularity}); the fused step takes int8 "
                f"per-row or per-tensor activation scales")
    if getattr(act.mapping_type, "name", None) != "SYMMETRIC" or getattr(act, "reduce_range", False):
        return "quantizes its activations asymmetrically or to a reduced range; the fused step takes symmetric int8"
    if getattr(w, "act_quant_scale", None) is not None:
        return "quantizes its activations with a static scale; the fused step takes dynamic activation quantization"
    if w.dtype != torch.float32:
        return f"quantizes the activations of a {w.dtype} model; the fused step does it in float32 models"
    return None


def activation_quantization(linear: nn.Linear) -> int:
    """How the fused step quantizes the activations of `linear` (csrc/matvec_dynamic.h): 0 not at all
    (float weights, int8 weight-only), 1 per row (torchao's dynamic int8, PerRow), 2 per tensor."""
    act = getattr(linear.weight, "act_quant_kwargs", None)
    if act is None:
        return 0
    return 1 if type(act.granularity).__name__ == "PerRow" else 2


def quantization_obstacle(model: nn.Module) -> str | None:
    """Why the fused step cannot read `model`'s quantized parameters (None: none, or all readable)."""
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not is_quantized(p):
                continue
            full = f"{name}.{pname}" if name else pname
            if not (isinstance(module, nn.Linear) and pname == "weight"):
                return (f"parameter {full} of a {type(module).__name__} is quantized ({type(p).__name__}); "
                        f"the fused step reads quantized nn.Linear weights only")
            why = _int8_obstacle(p)
            if why is not None:
                return f"parameter {full} {why}"
    return None


def plan_weight(linear: nn.Linear, dtype: torch.dtype) -> tuple[dict, int]:
    """A Linear's weight as the plan reads it, and its layout: 'kn' (1: Wt (in, out) contiguous, as
    linattn.nn.base.column_major stores it) or 'nk' (0: W (out, in) contiguous); with its bias.

    Float weights are read in place. An int8 weight-only one (torchao Int8Tensor) gives its int8 data
    in place and its scales as an (out,) float32 vector, rounded to the model's `dtype` as torchao's
    F.linear rounds them (scale.to(activation dtype))."""
    w = linear.weight.detach()
    t: dict = {}
    if is_quantized(w):
        q = w.qdata
        n = q.shape[0]
        scale = w.scale.detach().to(dtype).to(torch.float32).reshape(-1).expand(n).contiguous()
        kn = int(not q.is_contiguous())
        t.update(weight=q.t() if kn else q, scale=scale)
    else:
        kn = int(w.t().is_contiguous())
        t["weight"] = w.t() if kn else w.contiguous()
    if linear.bias is not None:
        t["bias"] = linear.bias.detach()
    return t, kn


def float_weight(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a plain tensor of `dtype`: a quantized one dequantized (s_j · q_j), a plain one as it is.
    For the few small matrices a mixer reads itself rather than through a product (GLA's decay
    up-projection, rank × heads·key_dim)."""
    return t.dequantize().to(dtype) if is_quantized(t) else t


__all__ = ["activation_quantization", "float_weight", "is_quantized", "plan_weight", "quantization_obstacle"]
