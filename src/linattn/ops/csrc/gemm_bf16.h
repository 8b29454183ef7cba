// Row-major gemm of bf16 operands into float results by register tiles, on CPUs with AVX512-BF16 (AMD
// Zen 4 and later, Intel Cooper Lake and Sapphire Rapids): C (M×N, float) = alpha·op(A) op(B) + beta·C,
// op(X) = Xᵀ when asked, beta = 0 not reading C. The bf16 products are exact and summed in float:
// vdpbf16ps adds, per 32-bit lane, the two products of a pair of k (k, k + 1) to a float accumulator,
// so one instruction does twice the multiply-adds of an fp32 FMA. Operands are bf16 bit patterns
// (uint16_t); blas.h routes gemm_rm<bf16, float> here (torch's MKL bf16 gemm stays for other CPUs).
//
// The tiles are those of gemm.h (12 rows × 2 vectors of 16 floats, 24 accumulators) over pairs of k:
// per pair, the two vectors of B hold 16 columns × (k, k + 1) each, and each row of op(A) is one 32-bit
// word (A[i][k], A[i][k + 1]) broadcast. So B is packed per block of KC = 256 values of k into pairs of
// rows interleaved (op(B) = B: two rows merged by a 16-bit permute; op(B) = Bᵀ: the 32-bit words of
// B's rows transposed, gemm.h's 16×16 transpose on the bit patterns), and op(A) = Aᵀ the same way;
// op(A) = A is read in place (its pairs are adjacent). An odd K leaves its last k to a float rank-1
// update after the tiles.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"

#if LINATTN_TILE_GEMM
#define LINATTN_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))
#endif

namespace {

// True where the bf16 tiles run: the fp32 tiles do (tile_gemm_enabled) and the CPU has AVX512-BF16.
inline bool bf16_tiles_enabled() {
#if LINATTN_TILE_GEMM
  static const bool on = tile_gemm_enabled() && __builtin_cpu_supports("avx512bf16");
  return on;
#else
  return false;
#endif
}

#if LINATTN_TILE_GEMM

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

inline float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// One R×(W·16) block of C over `pairs` pairs of k: the pair p of row r of op(A) is the word at
// a + r·ars + p·aps (uint16 elements), B's pair p is the row p of b (ldb words apart).
template <int R, int W, bool Tail>
LINATTN_AVX512BF16 inline void bf16_tile(int pairs, const uint16_t* a, int64_t ars, int64_t aps, const uint32_t* b,
                                         int64_t ldb, float* C, int ldc, float alpha, float beta, __mmask16 tail,
                                         const PrefetchQueue::Range hint = {nullptr, 0, false}) {
  const __mmask16 full = 0xFFFF, last = Tail ? tail : full;
  __m512 acc[R][W];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    hint_line(hint, p);  // one line of the hint per 4 steps
    const uint32_t* bp = b + static_cast<int64_t>(p) * ldb;
    __m512i bv[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) bv[w] = _mm512_maskz_loadu_epi32(w == W - 1 ? last : full, bp + w * 16);
    const uint16_t* ap = a + static_cast<int64_t>(p) * aps;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(pair_at(ap + r * ars)));
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_dpbf16_ps(acc[r][w], (__m512bh)av, (__m512bh)bv[w]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    float* c = C + static_cast<int64_t>(r) * ldc;
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      const __mmask16 m = w == W - 1 ? last : full;
      __m512 out = _mm512_mul_ps(va, acc[r][w]);
      if (beta != 0.0f) out = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, c + w * 16), out);
      _mm512_mask_storeu_ps(c + w * 16, m, out);
    }
  }
}

// The rows of one column panel: blocks of 12 rows, then the remaining 1–11 in one block.
template <int W, bool Tail>
LINATTN_AVX512BF16 void bf16_panel(int M, int pairs, const uint16_t* a, int64_t ars, int64_t aps, const uint32_t* b,
                                   int64_t ldb, float* C, int ldc, float alpha, float beta, __mmask16 last,
                                   PrefetchQueue& hints) {
  constexpr int R = 12;
  int i = 0;
  for (; i + R <= M; i += R)
    bf16_tile<R, W, Tail>(pairs, a + i * ars, ars, aps, b, ldb, C + static_cast<int64_t>(i) * ldc, ldc, alpha, beta,
                          last, hints.take(pairs / 4 + 1));
  const uint16_t* ai = a + i * ars;
  float* c = C + static_cast<int64_t>(i) * ldc;
  switch (M - i) {
    case 11: bf16_tile<11, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 10: bf16_tile<10, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 9: bf16_tile<9, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 8: bf16_tile<8, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 7: bf16_tile<7, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 6: bf16_tile<6, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 5: bf16_tile<5, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 4: bf16_tile<4, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 3: bf16_tile<3, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 2: bf16_tile<2, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    case 1: bf16_tile<1, W, Tail>(pairs, ai, ars, aps, b, ldb, c, ldc, alpha, beta, last); break;
    default: break;
  }
}

// C (M×N) = alpha·op(A) B + beta·C over `pairs` pairs of k, B packed (pairs × N words): panels of 32
// columns, then one of 16, then the last < 16 masked.
LINATTN_AVX512BF16 inline void bf16_tiles(int M, int N, int pairs, const uint16_t* a, int64_t ars, int64_t aps,
                                          const uint32_t* b, float beta, float* C, int ldc, float alpha,
                                          PrefetchQueue& hints) {
  int j = 0;
  for (; j + 32 <= N; j += 32)
    bf16_panel<2, false>(M, pairs, a, ars, aps, b + j, N, C + j, ldc, alpha, beta, 0xFFFF, hints);
  for (; j + 16 <= N; j += 16)
    bf16_panel<1, false>(M, pairs, a, ars, aps, b + j, N, C + j, ldc, alpha, beta, 0xFFFF, hints);
  if (j < N) {
    const auto last = static_cast<__mmask16>((1u << (N - j)) - 1u);
    bf16_panel<1, true>(M, pairs, a, ars, aps, b + j, N, C + j, ldc, alpha, beta, last, hints);
  }
}

// out (pairs × n words): row p holds (X[2p][j], X[2p + 1][j]) for the n columns j of the row-major X (ldx)
LINATTN_AVX512BF16 inline void interleave_rows(const uint16_t* X, int64_t ldx, int pairs, int n, uint32_t* out) {
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int e = 0; e < 32; ++e) {
    lo_idx[e] = static_cast<uint16_t>((e % 2) * 32 + e / 2);
    hi_idx[e] = static_cast<uint16_t>((e % 2) * 32 + 16 + e / 2);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int p = 0; p < pairs; ++p) {
    const uint16_t* r0 = X + 2 * p * ldx;
    const uint16_t* r1 = r0 + ldx;
    uint32_t* o = out + static_cast<int64_t>(p) * n;
    for (int j = 0; j < n; j += 32) {
      const int left = n - j;
      const __mmask32 m = left >= 32 ? ~0u : (1u << left) - 1u;
      const __m512i x0 = _mm512_maskz_loadu_epi16(m, r0 + j), x1 = _mm512_maskz_loadu_epi16(m, r1 + j);
      const __mmask16 m0 = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
      const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1u);
      _mm512_mask_storeu_epi32(o + j, m0, _mm512_permutex2var_epi16(x0, lo, x1));
      _mm512_mask_storeu_epi32(o + j + 16, m1, _mm512_permutex2var_epi16(x0, hi, x1));
    }
  }
}

// op(B)'s pairs of rows k0 … k0 + 2·pairs − 1 packed (pairs × N words) in this thread's buffer
LINATTN_AVX512BF16 inline const uint32_t* packed_b(bool tb, int N, int pairs, const uint16_t* B, int ldb, int k0) {
  if (tb && ldb % 2 == 0) {  // B's rows hold the pairs as words: transpose N × pairs words
    return reinterpret_cast<const uint32_t*>(
        transposed<float>(N, pairs, reinterpret_cast<const float*>(B + k0), ldb / 2));
  }
  thread_local std::vector<uint32_t> buf;
  buf.resize(static_cast<size_t>(pairs) * N);
  if (!tb) {
    interleave_rows(B + static_cast<int64_t>(k0) * ldb, ldb, pairs, N, buf.data());
  } else {  // an odd row stride: word by word
    for (int p = 0; p < pairs; ++p)
      for (int j = 0; j < N; ++j)
        buf[static_cast<size_t>(p) * N + j] = pair_at(B + static_cast<int64_t>(j) * ldb + k0 + 2 * p);
  }
  return buf.data();
}

// Row-major C (M×N, float) = alpha·op(A) op(B) + beta·C for bf16 A and B (bit patterns), by the tiles,
// over blocks of NC = 256 columns (the outer loop, as gemm_blocks: a k-block of B packed for 256 columns,
// 128 KB, stays in L2 while the row blocks pass; packed for all N columns of a wide projection it was
// N/2 KB per k-block, read from L3 by every row block) and KC = 256 values of k.
LINATTN_AVX512BF16 inline void bf16_gemm_rm(bool ta, bool tb, int M, int N, int K, const uint16_t* A, int lda,
                                            const uint16_t* B, int ldb, float beta, float* C, int ldc, float alpha) {
  if (M <= 0 || N <= 0) return;
  constexpr int NC = 256, KC = 256, MC = 120;
  const int even = K - K % 2;
  thread_local std::vector<uint32_t> a_buf;
  PrefetchQueue& hints = prefetch_queue();
  for (int n0 = 0; n0 < N; n0 += NC) {
    const int nb = std::min(NC, N - n0);
    const uint16_t* Bn = tb ? B + static_cast<int64_t>(n0) * ldb : B + n0;
    for (int k0 = 0;; k0 += KC) {
      const int pairs = std::min(KC, even - k0) / 2;
      const uint32_t* b = packed_b(tb, nb, pairs, Bn, ldb, k0);
      const uint16_t* a = A + k0;
      int64_t ars = lda, aps = 2;
      if (ta) {  // op(A) = Aᵀ: A's rows k0 … interleaved in pairs (pairs × M words)
        a_buf.resize(static_cast<size_t>(pairs) * M);
        interleave_rows(A + static_cast<int64_t>(k0) * lda, lda, pairs, M, a_buf.data());
        a = reinterpret_cast<const uint16_t*>(a_buf.data()), ars = 2, aps = 2 * int64_t(M);
      }
      for (int i0 = 0; i0 < M; i0 += MC)
        bf16_tiles(std::min(MC, M - i0), nb, pairs, a + i0 * ars, ars, aps, b, k0 == 0 ? beta : 1.0f,
                   C + static_cast<int64_t>(i0) * ldc + n0, ldc, alpha, hints);
      if (k0 + KC >= even) break;
    }
  }
  if (K % 2 == 1) {  // the last k: C += alpha · op(A)[:, K − 1] op(B)[K − 1, :]
    const int k = K - 1;
    for (int i = 0; i < M; ++i) {
      const uint16_t a = ta ? A[static_cast<int64_t>(k) * lda + i] : A[static_cast<int64_t>(i) * lda + k];
      const float ai = alpha * bf16_value(a);
      float* c = C + static_cast<int64_t>(i) * ldc;
      for (int j = 0; j < N; ++j)
        c[j] += ai * bf16_value(tb ? B[static_cast<int64_t>(j) * ldb + k] : B[static_cast<int64_t>(k) * ldb + j]);
    }
  }
}

#endif  // LINATTN_TILE_GEMM

}  // namespace
