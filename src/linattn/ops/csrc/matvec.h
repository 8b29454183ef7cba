// Matrix-vector products for decoding (model_step.cpp): y = x Wᵀ for a few rows x (the batch), with
// fp32 or bf16 weights and fp32 inputs, outputs and accumulation. Decoding one token reads every
// weight once and does one multiply-add with it per batch row, so at small batches these products are
// bound by the speed at which the weights stream from memory; the kernels keep that stream sequential
// and widen bf16 weights to fp32 in registers (exact: a bf16 value is the upper half of a float).
//
// Two layouts, both row-major in memory:
//   kn: Wt (K × N), the layout of linattn.layers.column_major weights (y_j = Σ_i x_i Wt[i, j]);
//   nk: W (N × K), nn.Linear's own layout and the tied embedding (y_j = W[j, :] · x).
// Each kernel computes the output columns [j0, j1) into y[b·ldy + (j − j0)], so threads can split a
// product by columns.
// Everything here has internal linkage (one copy per file).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

// 16 floats; GCC and clang lower these to one AVX-512 register, two AVX2 ones or four SSE ones
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#define LINATTN_INLINE inline __attribute__((always_inline))

LINATTN_INLINE v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

LINATTN_INLINE v16f load16(const at::BFloat16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  const v16u u = __builtin_convertvector(h, v16u) << 16;
  return reinterpret_cast<const v16f&>(u);
}

LINATTN_INLINE void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

LINATTN_INLINE float widen(float x) { return x; }
LINATTN_INLINE float widen(at::BFloat16 x) { return static_cast<float>(x); }

LINATTN_INLINE float lane_sum(v16f v) {
  float s = 0;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// float -> the nearest bf16 value, as a float (round to nearest even; NaN stays NaN)
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if (x != x) return x;
  u = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

// Columns of the output panel kept in cache while the rows stream past: B·panel floats ≤ 16 KiB
inline int64_t panel_columns(int64_t batch) { return std::max<int64_t>(16, (4096 / std::max<int64_t>(batch, 1)) / 16 * 16); }

// y[b·ldy + j − j0] = Σ_i x[b·ldx + i] Wt[i·ldw + j] for b < B, j in [j0, j1). Rows are taken eight at a
// time: each group of eight weight vectors is loaded once and used for every batch row, and the
// partial sums of a panel of columns stay in L1 while the weight rows stream sequentially.
template <typename W>
LINATTN_CLONES void matvec_kn(const W* __restrict__ Wt, int64_t ldw, int64_t K, const float* __restrict__ x,
                              int64_t ldx, int64_t B, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  constexpr int R = 8;
  const int64_t panel = panel_columns(B);
  for (int64_t p0 = j0; p0 < j1; p0 += panel) {
    const int64_t p1 = std::min(j1, p0 + panel), vec_end = p0 + (p1 - p0) / 16 * 16;
    float* __restrict__ yp = y + (p0 - j0);  // the panel's first column
    for (int64_t b = 0; b < B; ++b) std::fill(yp + b * ldy, yp + b * ldy + (p1 - p0), 0.0f);
    int64_t i = 0;
    for (; i + R <= K; i += R) {
      const W* __restrict__ row = Wt + i * ldw;
      for (int64_t j = p0; j < vec_end; j += 16) {
        v16f w[R];
        for (int r = 0; r < R; ++r) w[r] = load16(row + r * ldw + j);
        float* yj = yp + (j - p0);
        for (int64_t b = 0; b < B; ++b) {
          const float* __restrict__ xb = x + b * ldx + i;
          v16f a = load16(yj + b * ldy);
          for (int r = 0; r < R; ++r) a += xb[r] * w[r];
          store16(yj + b * ldy, a);
        }
      }
      for (int64_t j = vec_end; j < p1; ++j) {
        for (int64_t b = 0; b < B; ++b) {
          float a = yp[b * ldy + (j - p0)];
          for (int r = 0; r < R; ++r) a += x[b * ldx + i + r] * widen(row[r * ldw + j]);
          yp[b * ldy + (j - p0)] = a;
        }
      }
    }
    for (; i < K; ++i) {
      const W* __restrict__ row = Wt + i * ldw;
      for (int64_t b = 0; b < B; ++b) {
        const float xi = x[b * ldx + i];
        float* yb = yp + b * ldy;
        for (int64_t j = p0; j < vec_end; j += 16) store16(yb + (j - p0), load16(yb + (j - p0)) + xi * load16(row + j));
        for (int64_t j = vec_end; j < p1; ++j) yb[j - p0] += xi * widen(row[j]);
      }
    }
  }
}

// BB batch rows × JR output rows j, j + 1, …: y[b·ldy + r] = W[(j + r)·ldw + :] · x[b·ldx + :]
template <typename W, int BB, int JR>
LINATTN_INLINE void dot_tile(const W* __restrict__ Wr, int64_t ldw, int64_t K, const float* __restrict__ x, int64_t ldx,
                     float* __restrict__ y, int64_t ldy, int64_t j) {
  v16f acc[BB][JR];
  for (int b = 0; b < BB; ++b)
    for (int r = 0; r < JR; ++r) acc[b][r] = v16f{};
  const int64_t kv = K / 16 * 16;
  for (int64_t i = 0; i < kv; i += 16) {
    v16f w[JR];
    for (int r = 0; r < JR; ++r) w[r] = load16(Wr + (j + r) * ldw + i);
    for (int b = 0; b < BB; ++b) {
      const v16f xb = load16(x + b * ldx + i);
      for (int r = 0; r < JR; ++r) acc[b][r] += xb * w[r];
    }
  }
  for (int b = 0; b < BB; ++b) {
    for (int r = 0; r < JR; ++r) {
      float s = lane_sum(acc[b][r]);
      for (int64_t i = kv; i < K; ++i) s += x[b * ldx + i] * widen(Wr[(j + r) * ldw + i]);
      y[b * ldy + r] = s;
    }
  }
}

template <typename W, int BB>
LINATTN_INLINE void dot_rows(const W* __restrict__ Wr, int64_t ldw, int64_t K, const float* __restrict__ x,
                             int64_t ldx, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  constexpr int JR = BB > 4 ? 2 : 4;  // at most 16 accumulators
  int64_t j = j0;
  for (; j + JR <= j1; j += JR) dot_tile<W, BB, JR>(Wr, ldw, K, x, ldx, y + (j - j0), ldy, j);
  for (; j < j1; ++j) dot_tile<W, BB, 1>(Wr, ldw, K, x, ldx, y + (j - j0), ldy, j);
}

// y[b·ldy + j − j0] = Σ_i W[j·ldw + i] x[b·ldx + i] for b < B, j in [j0, j1): dot products of weight rows
// with up to eight batch rows at a time
template <typename W>
LINATTN_CLONES void matvec_nk(const W* __restrict__ Wr, int64_t ldw, int64_t K, const float* __restrict__ x,
                              int64_t ldx, int64_t B, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  int64_t b = 0;
  for (; b + 8 <= B; b += 8) dot_rows<W, 8>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
  for (; b + 4 <= B; b += 4) dot_rows<W, 4>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
  for (; b + 2 <= B; b += 2) dot_rows<W, 2>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
  for (; b < B; ++b) dot_rows<W, 1>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
}

}  // namespace
