// Row-major float / double gemm by register tiles, on CPUs with AVX-512: C (M×N) = alpha·op(A) op(B)
// + beta·C, op(X) = Xᵀ when asked, beta = 0 not reading C (BLAS's rule). The fused kernels' products
// (chunk × head-dim blocks: 64×128×128 and the like) and linattn.nn.Linear's run on it.
//
// Why not the BLAS: torch's MKL packs both operands into its own layout on every call, and on the AMD
// processor of this project's runs it reached ~105–118 GFLOP/s on one core whatever the shape; the tiles
// below ran a hot 64×128×128 product in 7.9 µs against MKL's 20 (265 GFLOP/s, a first 8-row version in
// a stand-alone test) and products of a linear layer's size (2048 × 1024 · 1024 × 3072) at ~210 against
// 104. Each tile keeps an R×(W·L) block of C in registers (R = 12 rows, W = 2 vectors of L = 16 floats
// or 8 doubles: 24 of the 32 zmm registers; 8 rows ran large products ~10% slower, 14 spilled to the
// stack) and walks k once: per k, W loads of B's row, R broadcasts of A's elements, R·W fused
// multiply-adds, k in order (the sums of a plain loop over k). op(B) = B is read in place (its rows are
// contiguous); op(B) = Bᵀ is transposed block by block into a per-thread buffer (gemm_blocks). Columns
// past the last full vector run with masked loads and stores. LINATTN_GEMM=blas keeps every product on
// the BLAS (MKL stays for bf16 and CPUs without AVX-512 anyway).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "prefetch.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define LINATTN_TILE_GEMM 1
#define LINATTN_AVX512 __attribute__((target("avx512f,fma")))
#else
#define LINATTN_TILE_GEMM 0
#endif

namespace {

// True where the tiles run: an x86-64 build, a CPU with AVX-512F, LINATTN_GEMM not "blas" (read once).
inline bool tile_gemm_enabled() {
#if LINATTN_TILE_GEMM
  static const bool on = [] {
    const char* env = std::getenv("LINATTN_GEMM");
    return __builtin_cpu_supports("avx512f") && !(env != nullptr && std::strcmp(env, "blas") == 0);
  }();
  return on;
#else
  return false;
#endif
}

#if LINATTN_TILE_GEMM

template <typename T>
struct Zmm;

template <>
struct Zmm<float> {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int L = 16;
  LINATTN_AVX512 static V zero() { return _mm512_setzero_ps(); }
  LINATTN_AVX512 static V set1(float x) { return _mm512_set1_ps(x); }
  LINATTN_AVX512 static V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  LINATTN_AVX512 static void store(float* p, V v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
  LINATTN_AVX512 static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  LINATTN_AVX512 static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
};

template <>
struct Zmm<double> {
  using V = __m512d;
  using Mask = __mmask8;
  static constexpr int L = 8;
  LINATTN_AVX512 static V zero() { return _mm512_setzero_pd(); }
  LINATTN_AVX512 static V set1(double x) { return _mm512_set1_pd(x); }
  LINATTN_AVX512 static V load(const double* p, Mask m) { return _mm512_maskz_loadu_pd(m, p); }
  LINATTN_AVX512 static void store(double* p, V v, Mask m) { _mm512_mask_storeu_pd(p, m, v); }
  LINATTN_AVX512 static V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  LINATTN_AVX512 static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
};

// One R×(W·L) block of C: rows of op(A) from A (row r, column k at A[r·lda + k], or A[k·lda + r] when
// TA), columns from B's rows (ldb apart); with Tail, the last vector of each row under `tail` (a column
// mask), else every vector whole. The lines of `hint` (prefetch.h) are issued one per 4 k-steps.
template <typename T, int R, int W, bool TA, bool Tail>
LINATTN_AVX512 inline void gemm_tile(int K, const T* A, int lda, const T* B, int ldb, T* C, int ldc, T alpha, T beta,
                                     typename Zmm<T>::Mask tail, const PrefetchQueue::Range hint = {nullptr, 0, false}) {
  using Z = Zmm<T>;
  constexpr int L = Z::L;
  const typename Z::Mask full = static_cast<typename Z::Mask>(~0u), last = Tail ? tail : full;
  typename Z::V acc[R][W];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) acc[r][w] = Z::zero();
  for (int k = 0; k < K; ++k) {
    hint_line(hint, k);  // one line of the hint per 4 steps
    const T* b = B + static_cast<int64_t>(k) * ldb;
    typename Z::V bv[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) bv[w] = Z::load(b + w * L, w == W - 1 ? last : full);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const typename Z::V a = Z::set1(TA ? A[static_cast<int64_t>(k) * lda + r] : A[static_cast<int64_t>(r) * lda + k]);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = Z::fma(a, bv[w], acc[r][w]);
    }
  }
  const typename Z::V va = Z::set1(alpha), vb = Z::set1(beta);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    T* c = C + static_cast<int64_t>(r) * ldc;
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      const typename Z::Mask m = w == W - 1 ? last : full;
      typename Z::V out = Z::mul(va, acc[r][w]);
      if (beta != T(0)) out = Z::fma(vb, Z::load(c + w * L, m), out);
      Z::store(c + w * L, out, m);
    }
  }
}

// The rows of one column panel: blocks of 12 rows, then the remaining 1–11 in one block.
template <typename T, int W, bool TA, bool Tail>
LINATTN_AVX512 void gemm_panel(int M, int K, const T* A, int lda, const T* B, int ldb, T* C, int ldc, T alpha, T beta,
                               typename Zmm<T>::Mask last, PrefetchQueue& hints) {
  constexpr int R = 12;
  int i = 0;
  auto a_at = [&](int row) { return TA ? A + row : A + static_cast<int64_t>(row) * lda; };
  for (; i + R <= M; i += R)  // the tile issues one queued line per 4 k-steps: ~1,500 lines over a chunk
    gemm_tile<T, R, W, TA, Tail>(K, a_at(i), lda, B, ldb, C + static_cast<int64_t>(i) * ldc, ldc, alpha, beta, last,
                                 hints.take(K / 4 + 1));
  T* c = C + static_cast<int64_t>(i) * ldc;
  switch (M - i) {
    case 11: gemm_tile<T, 11, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 10: gemm_tile<T, 10, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 9: gemm_tile<T, 9, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 8: gemm_tile<T, 8, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 7: gemm_tile<T, 7, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 6: gemm_tile<T, 6, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 5: gemm_tile<T, 5, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 4: gemm_tile<T, 4, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 3: gemm_tile<T, 3, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 2: gemm_tile<T, 2, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    case 1: gemm_tile<T, 1, W, TA, Tail>(K, a_at(i), lda, B, ldb, c, ldc, alpha, beta, last); break;
    default: break;
  }
}

// C = alpha·op(A) B + beta·C with B K×N row-major (ldb): panels of 2L columns, then one of L, then
// the last < L columns masked.
template <typename T, bool TA>
LINATTN_AVX512 void gemm_tiles(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C, int ldc,
                               T alpha, PrefetchQueue& hints) {
  using Z = Zmm<T>;
  constexpr int L = Z::L;
  const typename Z::Mask full = static_cast<typename Z::Mask>(~0u);
  int j = 0;
  for (; j + 2 * L <= N; j += 2 * L)
    gemm_panel<T, 2, TA, false>(M, K, A, lda, B + j, ldb, C + j, ldc, alpha, beta, full, hints);
  for (; j + L <= N; j += L)
    gemm_panel<T, 1, TA, false>(M, K, A, lda, B + j, ldb, C + j, ldc, alpha, beta, full, hints);
  if (j < N) {
    const auto last = static_cast<typename Z::Mask>((1u << (N - j)) - 1u);
    gemm_panel<T, 1, TA, true>(M, K, A, lda, B + j, ldb, C + j, ldc, alpha, beta, last, hints);
  }
}

// dst (L×L, ldd) = src (L×L, lds)ᵀ in registers: L = 16 floats by interleaving 32-bit elements, then
// 64-bit pairs, then 128-bit lanes twice; L = 8 doubles by 64-bit elements, then lanes twice.
LINATTN_AVX512 inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
    _mm512_storeu_ps(dst + (8 + j) * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));
  }
}

LINATTN_AVX512 inline void transpose_block(const double* src, int64_t lds, double* dst, int64_t ldd) {
  __m512d r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm512_loadu_pd(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_pd(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_pd(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      r[4 * i + j] = _mm512_shuffle_f64x2(t[4 * i + j], t[4 * i + 2 + j], 0x88);
      r[4 * i + 2 + j] = _mm512_shuffle_f64x2(t[4 * i + j], t[4 * i + 2 + j], 0xdd);
    }
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_pd(dst + j * ldd, _mm512_shuffle_f64x2(r[j], r[4 + j], 0x88));
    _mm512_storeu_pd(dst + (4 + j) * ldd, _mm512_shuffle_f64x2(r[j], r[4 + j], 0xdd));
  }
}

// Bᵀ of the row-major N×K matrix B (ldb) as a K×N row-major matrix in this thread's buffer: L×L blocks
// in registers, the edges (N or K not a multiple of L) element by element.
template <typename T>
LINATTN_AVX512 const T* transposed(int N, int K, const T* B, int ldb) {
  constexpr int L = Zmm<T>::L;
  thread_local std::vector<T> buf;
  buf.resize(static_cast<size_t>(N) * K);
  T* out = buf.data();
  const int N0 = N - N % L, K0 = K - K % L;
  for (int j = 0; j < N0; j += L)
    for (int k = 0; k < K0; k += L)
      transpose_block(B + static_cast<int64_t>(j) * ldb + k, ldb, out + static_cast<int64_t>(k) * N + j, N);
  for (int j = 0; j < N; ++j)
    for (int k = j < N0 ? K0 : 0; k < K; ++k) out[static_cast<int64_t>(k) * N + j] = B[static_cast<int64_t>(j) * ldb + k];
  return out;
}

// gemm_tiles over blocks of NC = 256 columns, KC = 256 values of k (a 2L-column panel of B, 32 KB,
// stays in L1 while the rows pass; the block's KC×NC of B, 256 KB, in L2 while the row blocks pass) and
// MC = 120 rows (ten tiles; their KC columns of A, 120 KB, stay in L2 while the panels pass); the blocks
// after the first in k add to C (beta 1). With tb, B is N×K and each block's KC×NC of it is transposed
// as the block starts (into a per-thread buffer). Without the column blocks, a linear layer's product
// of 512 × 1024 by 1024 × 8192 transposed 8 MB of B per k block, which the row blocks then read from L3:
// 161 GFLOP/s on one AMD EPYC core against 219 with them (the best of 5, a stand-alone harness; 512³:
// 234 → 247). The chunked kernels' products are one block.
template <typename T, bool TA>
void gemm_blocks(bool tb, int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C, int ldc,
                 T alpha) {
  constexpr int NC = 256, KC = 256, MC = 120;
  PrefetchQueue& hints = prefetch_queue();  // one thread-local lookup per product, not per panel
  for (int n0 = 0; n0 < N; n0 += NC) {
    const int nb = std::min(NC, N - n0);
    for (int k0 = 0;; k0 += KC) {
      const int kb = std::min(KC, K - k0);
      const T* b = tb ? transposed(nb, kb, B + static_cast<int64_t>(n0) * ldb + k0, ldb)
                      : B + static_cast<int64_t>(k0) * ldb + n0;
      const int ld = tb ? nb : ldb;
      for (int i0 = 0; i0 < M; i0 += MC) {
        const T* a = TA ? A + static_cast<int64_t>(k0) * lda + i0 : A + static_cast<int64_t>(i0) * lda + k0;
        gemm_tiles<T, TA>(std::min(MC, M - i0), nb, kb, a, lda, b, ld, k0 == 0 ? beta : T(1),
                          C + static_cast<int64_t>(i0) * ldc + n0, ldc, alpha, hints);
      }
      if (k0 + KC >= K) break;
    }
  }
}

// Row-major C (M×N) = alpha·op(A) op(B) + beta·C by the tiles (float or double).
template <typename T>
void tile_gemm_rm(bool ta, bool tb, int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
                  int ldc, T alpha) {
  if (M <= 0 || N <= 0) return;
  if (ta)
    gemm_blocks<T, true>(tb, M, N, K, A, lda, B, ldb, beta, C, ldc, alpha);
  else
    gemm_blocks<T, false>(tb, M, N, K, A, lda, B, ldb, beta, C, ldc, alpha);
}

#endif  // LINATTN_TILE_GEMM

}  // namespace
