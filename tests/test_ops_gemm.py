"""The fused kernels' own row-major product (csrc/gemm.h through `linattn_cpu::gemm`): every transpose
combination, row and column tails (masked last vectors, 1–7 leftover rows), alpha and beta, against
float64 products; beta = 0 does not read C; LINATTN_GEMM=blas keeps the BLAS."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.ops import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels are not built")


def _reference(a, b, c, ta, tb, alpha, beta):
    A = a.double().transpose(1, 2) if ta else a.double()
    B = b.double().transpose(1, 2) if tb else b.double()
    return alpha * (A @ B) + (beta * c.double() if beta != 0 else 0)


def _operands(batch, m, n, k, ta, tb, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, *((k, m) if ta else (m, k)), generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(batch, *((n, k) if tb else (k, n)), generator=g, dtype=torch.float64).to(dtype)
    c = torch.randn(batch, m, n, generator=g, dtype=torch.float64).to(dtype)
    return a, b, c


@settings(max_examples=120, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(0, 40), batch=st.integers(1, 3),
       ta=st.booleans(), tb=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       alpha=st.sampled_from([1.0, -0.5, 2.0]), beta=st.sampled_from([0.0, 1.0, 0.25]), seed=st.integers(0, 99))
def test_gemm_matches_float64_products(m, n, k, batch, ta, tb, dtype, alpha, beta, seed):
    a, b, c = _operands(batch, m, n, k, ta, tb, dtype, seed)
    want = _reference(a, b, c, ta, tb, alpha, beta)
    out = c.clone()
    torch.ops.linattn_cpu.gemm(a, b, out, ta, tb, alpha, beta)
    # a float32 product of k terms: each term rounded once and each partial sum once
    big = [t.double().abs().max().item() if t.numel() else 0.0 for t in (a, b, c)]
    scale = (k + 2) * (abs(alpha) * big[0] * big[1] + abs(beta) * big[2] + 1)
    tol = (1e-15 if dtype == torch.float64 else 1e-7) * 4 * float(scale)
    assert out.dtype == dtype
    assert (out.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("m, n, k", [(64, 128, 128), (128, 64, 64), (16, 127, 128), (8, 32, 1), (1, 1, 1)])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_chunk_shapes_in_float64(m, n, k, ta, tb):
    """The kernels' own block shapes (chunk 64 or 16 rows, head dims 64 and 128, a 127-key span)."""
    a, b, c = _operands(2, m, n, k, ta, tb, torch.float64, 0)
    out = c.clone()
    torch.ops.linattn_cpu.gemm(a, b, out, ta, tb, 1.0, 1.0)
    torch.testing.assert_close(out, _reference(a, b, c, ta, tb, 1.0, 1.0), rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("m, n, k", [(300, 100, 600), (130, 200, 257), (129, 33, 256), (130, 600, 300),
                                     (40, 257, 520)])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_blocks_of_k_and_rows_and_column_splits(m, n, k, tb, threads):
    """Products larger than one block (k > 256 in blocks added to C, rows in blocks of 120, columns in
    blocks of 256, the last one partial) and, with one product and two threads, its columns split between
    the threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for ta in (False, True):
            a, b, c = _operands(1, m, n, k, ta, tb, torch.float64, 3)
            out = c.clone()
            torch.ops.linattn_cpu.gemm(a, b, out, ta, tb, 0.5, 0.25)
            torch.testing.assert_close(out, _reference(a, b, c, ta, tb, 0.5, 0.25), rtol=1e-13, atol=1e-11)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gemm_beta_zero_does_not_read_c(dtype):
    a, b, _ = _operands(2, 9, 37, 11, False, True, dtype, 1)
    out = torch.full((2, 9, 37), float("nan"), dtype=dtype)
    torch.ops.linattn_cpu.gemm(a, b, out, False, True, 1.0, 0.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), a.double() @ b.double().transpose(1, 2),
                               rtol=1e-5 if dtype == torch.float32 else 1e-13, atol=1e-5)


def _bf16_products(a, b, c, ta, tb, alpha, beta, threads=1):
    """linattn's gemm of bf16 a, b into the float32 c against the float64 product of the same bf16
    values: products exact, summed in float, so within (k + 2) float roundings of the magnitudes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = c.clone()
        torch.ops.linattn_cpu.gemm(a, b, out, ta, tb, alpha, beta)
    finally:
        torch.set_num_threads(before)
    A = a.double().transpose(1, 2) if ta else a.double()
    B = b.double().transpose(1, 2) if tb else b.double()
    want = alpha * (A @ B) + (beta * c.double() if beta != 0 else 0)
    scale = abs(alpha) * (A.abs() @ B.abs()) + (abs(beta) * c.double().abs() if beta != 0 else 0) + 1
    k = A.shape[-1]
    assert out.dtype == torch.float32
    assert ((out.double() - want).abs() <= 4e-7 * (k + 2) * scale).all()


@settings(max_examples=120, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(0, 41), batch=st.integers(1, 3),
       ta=st.booleans(), tb=st.booleans(), alpha=st.sampled_from([1.0, -0.5, 2.0]),
       beta=st.sampled_from([0.0, 1.0, 0.25]), seed=st.integers(0, 99))
def test_bf16_gemm_matches_float64_products(m, n, k, batch, ta, tb, alpha, beta, seed):
    """bf16 operands, float32 results (csrc/gemm_bf16.h where the CPU has AVX512-BF16, else MKL's bf16
    gemm): odd k (the last k outside the pairs), row and column tails, every transpose pair."""
    a, b, c = _operands(batch, m, n, k, ta, tb, torch.float64, seed)
    c = c.float() if beta != 0 else torch.full(c.shape, float("nan"))  # beta = 0 does not read c
    _bf16_products(a.bfloat16(), b.bfloat16(), c, ta, tb, alpha, beta)


@pytest.mark.parametrize("m, n, k", [(64, 128, 128), (64, 64, 127), (300, 100, 600), (129, 33, 513), (24, 17, 1),
                                     (40, 600, 300), (13, 257, 65)])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_gemm_blocks_and_chunk_shapes(m, n, k, ta, tb, threads):
    """The kernels' chunk products, and products over several blocks of k (pairs packed per block of
    256), of columns (blocks of 256, the last partial: N = 600, 257) and of rows, one product's columns
    split between two threads."""
    a, b, c = _operands(1, m, n, k, ta, tb, torch.float64, 5)
    _bf16_products(a.bfloat16(), b.bfloat16(), c.float(), ta, tb, 0.5, 0.25, threads)


def test_bf16_gemm_odd_row_stride_of_transposed_b():
    """op(B) = Bᵀ with an odd row stride (its pairs are not whole 32-bit words of the rows): word by word."""
    a, b, c = _operands(1, 13, 20, 7, False, True, torch.float64, 6)
    _bf16_products(a.bfloat16(), b.bfloat16(), c.float(), False, True, 1.0, 1.0)


def test_gemm_rejects_mismatched_operands_by_name():
    a, b, c = _operands(1, 4, 5, 6, False, False, torch.float32, 0)
    with pytest.raises(RuntimeError, match="b's shape"):
        torch.ops.linattn_cpu.gemm(a, b.transpose(1, 2).contiguous(), c, False, False, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="c must have shape"):
        torch.ops.linattn_cpu.gemm(a, b, c[:, :3].contiguous(), False, False, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="float32 or all float64"):
        torch.ops.linattn_cpu.gemm(a, b.double(), c, False, False, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="a and b bfloat16 with c float32"):
        torch.ops.linattn_cpu.gemm(a.bfloat16(), b.bfloat16(), c.bfloat16(), False, False, 1.0, 0.0)


def test_linattn_gemm_blas_keeps_the_blas():
    """LINATTN_GEMM=blas turns the tiles off (read once per process); the products stay right."""
    code = ("import torch; from linattn.ops import native; assert native.load(); "
            "a = torch.randn(2, 5, 7, dtype=torch.float64); b = torch.randn(2, 7, 3, dtype=torch.float64); "
            "c = torch.empty(2, 5, 3, dtype=torch.float64); torch.ops.linattn_cpu.gemm(a, b, c, False, False, 1.0, 0.0); "
            "assert torch.allclose(c, a @ b); x = torch.randn(1, 6, 5).bfloat16(); y = torch.randn(1, 5, 4).bfloat16(); "
            "z = torch.empty(1, 6, 4); torch.ops.linattn_cpu.gemm(x, y, z, False, False, 1.0, 0.0); "
            "assert torch.allclose(z, x.float() @ y.float(), atol=1e-5); "
            "assert not torch.ops.linattn_cpu.uses_bf16_tiles(); print(torch.ops.linattn_cpu.uses_tile_gemm())")
    env = {**os.environ, "LINATTN_GEMM": "blas"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
