"""Kimi Delta Attention (KDA; design §18): the delta rule with one forget gate per key channel. The
public operators (`rule`: `kda`, `kda_step`, `kda_affine_form`), the chunked torch-op path with its
block-recomputing backward (`chunked`), the fused CPU step (`fused`, csrc/kda.cpp), the gate helpers
of Kimi Linear and FLA (`gate`), and the float64 token-by-token recurrence the tests hold them to
(`reference`)."""

from . import reference
from .gate import kda_gate, kda_lowerbound_gate
from .api import kda, kda_affine_form, kda_step

__all__ = ["kda", "kda_affine_form", "kda_gate", "kda_lowerbound_gate", "kda_step", "reference"]
