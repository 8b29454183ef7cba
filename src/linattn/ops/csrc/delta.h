// The pieces of the delta family's fused chunked kernels shared by delta.cpp (no gate, one decay per
// head) and kda.cpp (one decay per key channel): the saved-state block size, the strip triangular
// solve, loading (and L2-normalizing) rows, the corrected values, row scalings and the chain through
// the normalization. Internal linkage (one copy per file), like common.h.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "blas.h"
#include "common.h"
#include "step_rows.h"

namespace {

constexpr int64_t kBlock = 256;  // tokens per saved state (rounded to whole chunks)

int64_t block_tokens(int64_t chunk) { return std::max<int64_t>(chunk, (kBlock / chunk) * chunk); }

bool delta_has_blas() {
  return has_blas() && blas_trsm<float>() != nullptr && blas_trsm<double>() != nullptr;
}

// B ← L⁻¹ B, or L⁻ᵀ B with trans, in place on the row-major c×E matrix B; L is unit lower triangular
// with its strictly lower part in the row-major c×c matrix A (diagonal and upper part not read). By
// substitution on strips of W columns held in registers, two partial sums per row so that the FMA
// chains overlap (64×64 fp32 on one core: 6.4 µs, MKL's strsm 13 µs, a 64×64×64 sgemm 5.9 µs);
// columns beyond the last whole strip go to the BLAS trsm.
template <typename Acc>
LINATTN_CLONES void solve_strips(bool trans, int c, int64_t E, const Acc* __restrict__ A, Acc* __restrict__ B) {
  constexpr int W = 128 / sizeof(Acc);  // two 512-bit registers
  int64_t x0 = 0;
  for (; x0 + W <= E; x0 += W) {
    for (int ii = 0; ii < c; ++ii) {
      const int i = trans ? c - 1 - ii : ii;
      const int j0 = trans ? i + 1 : 0, j1 = trans ? c : i;
      const int64_t step = trans ? c : 1;  // A_ij along a row of A, or A_ji down a column
      const Acc* __restrict__ a = trans ? A + int64_t(j0) * c + i : A + int64_t(i) * c;
      Acc acc[W], acc2[W];
      for (int x = 0; x < W; ++x) {
        acc[x] = B[i * E + x0 + x];
        acc2[x] = Acc(0);
      }
      int j = j0;
      for (; j + 1 < j1; j += 2) {
        const Acc a1 = a[(j - j0) * step], a2 = a[(j + 1 - j0) * step];
        const Acc* __restrict__ b1 = B + j * E + x0;
        const Acc* __restrict__ b2 = b1 + E;
        for (int x = 0; x < W; ++x) {
          acc[x] -= a1 * b1[x];
          acc2[x] -= a2 * b2[x];
        }
      }
      if (j < j1) {
        const Acc a1 = a[(j - j0) * step];
        const Acc* __restrict__ b1 = B + j * E + x0;
        for (int x = 0; x < W; ++x) acc[x] -= a1 * b1[x];
      }
      for (int x = 0; x < W; ++x) B[i * E + x0 + x] = acc[x] + acc2[x];
    }
  }
  if (x0 < E) solve_unit_lower<Acc>(trans, c, static_cast<int>(E - x0), A, B + x0, static_cast<int>(E));
}

// c rows of q or k (D wide) as Acc in dst: the rows themselves, or with l2norm x / √(‖x‖² + ε), the
// factor 1 / √(‖x‖² + ε) of row i in rnorm[i]
template <typename T, typename Acc>
LINATTN_CLONES void load_rows(const T* __restrict__ src, Acc* __restrict__ dst, Acc* __restrict__ rnorm, int c,
                              int64_t D, bool l2norm) {
  if constexpr (std::is_same<T, Acc>::value) {
    std::memcpy(dst, src, sizeof(Acc) * c * D);
  } else {
    widen_bf16(src, dst, int64_t(c) * D);
  }
  if (!l2norm) return;
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ x = dst + i * D;
    Acc ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
    const Acc r = inverse_norm(x, D, ss);
    rnorm[i] = r;
    for (int64_t d = 0; d < D; ++d) x[d] *= r;
  }
}

// V'_i = β_i X_i with X_i = V_i − e^{b_i} (K̂S)_i (eb = nullptr: 1), X kept when X != nullptr
template <typename T, typename Acc>
LINATTN_CLONES void corrected_values(const T* __restrict__ V, const Acc* __restrict__ KS, const Acc* __restrict__ eb,
                                     const Acc* __restrict__ beta, Acc* __restrict__ X, Acc* __restrict__ Vp, int c,
                                     int64_t E) {
  for (int i = 0; i < c; ++i) {
    const Acc e = eb != nullptr ? eb[i] : Acc(1), bi = beta[i];
#pragma omp simd
    for (int64_t x = 0; x < E; ++x) {
      const Acc xi = static_cast<Acc>(V[i * E + x]) - e * KS[i * E + x];
      if (X != nullptr) X[i * E + x] = xi;
      Vp[i * E + x] = bi * xi;
    }
  }
}

// Y_i = a_i X_i for the c rows of X (n wide); in place when Y == X
template <typename Acc>
LINATTN_CLONES void scale_rows(const Acc* X, const Acc* __restrict__ a, Acc* Y, int c, int64_t n) {
  for (int i = 0; i < c; ++i) {
    const Acc ai = a[i];
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) Y[i * n + x] = ai * X[i * n + x];
  }
}

// out (T) = s · X for n values
template <typename T, typename Acc>
LINATTN_CLONES void store_scaled(Acc* __restrict__ X, Acc s, T* __restrict__ out, int64_t n) {
  if constexpr (std::is_same<T, Acc>::value) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = s * X[i];
  } else {
    if (s != Acc(1)) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) X[i] *= s;
    }
    narrow_bf16(X, out, n);
  }
}

template <typename Acc>
LINATTN_CLONES void scale_all(Acc* __restrict__ X, Acc s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) X[i] *= s;
}

// One row's inputs: q, k (N×D), v (N×E), β, g (N, or N×D per key channel; nullptr without a gate)
template <typename T, typename Acc>
struct Row {
  const T *q, *k, *v;
  const Acc *beta, *g;
};

// Outputs of the backward for one row
template <typename T, typename Acc>
struct RowGrads {
  const T* dO;
  T *dq, *dk, *dv;
  Acc *dbeta, *dg;  // dg nullptr without a gate
};

// ∂L/∂x of n = x / √(‖x‖² + ε) for c rows (l2norm), or ∂L/∂x = ∂L/∂n: r (dn − n (n · dn)), as T
template <typename T, typename Acc>
LINATTN_CLONES void chain_rows(const Acc* __restrict__ dn, const Acc* __restrict__ n, const Acc* __restrict__ rnorm,
                               bool l2norm, T* __restrict__ out, int c, int64_t D) {
  for (int i = 0; i < c; ++i) {
    const Acc* __restrict__ g = dn + i * D;
    const Acc* __restrict__ x = n + i * D;
    T* __restrict__ y = out + i * D;
    if (!l2norm) {
      for (int64_t d = 0; d < D; ++d) y[d] = static_cast<T>(g[d]);
      continue;
    }
    Acc dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += x[d] * g[d];
    const Acc r = rnorm[i];
    for (int64_t d = 0; d < D; ++d) y[d] = static_cast<T>(r * (g[d] - x[d] * dot));
  }
}

// Σ_d a_i X_id Y_id per row i (n wide) added to out[i] with sign s
template <typename Acc>
LINATTN_CLONES void add_row_dots(const Acc* __restrict__ X, const Acc* __restrict__ Y, const Acc* __restrict__ a, Acc s,
                                 Acc* __restrict__ out, int c, int64_t n) {
  for (int i = 0; i < c; ++i) {
    Acc dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t x = 0; x < n; ++x) dot += X[i * n + x] * Y[i * n + x];
    out[i] += s * (a != nullptr ? a[i] : Acc(1)) * dot;
  }
}

// Y_i += s a_i X_i for the c rows (n wide)
template <typename Acc>
LINATTN_CLONES void add_scaled_rows(const Acc* __restrict__ X, const Acc* __restrict__ a, Acc s, Acc* __restrict__ Y,
                                    int c, int64_t n) {
  for (int i = 0; i < c; ++i) {
    const Acc ai = s * a[i];
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) Y[i * n + x] += ai * X[i * n + x];
  }
}

// The ungated score cotangents of row i of a chunk (c wide): with H_i the cotangent of the row's
// solved scores, H_ij ← −β_i H_ij below the diagonal (j < i), returning Σ_j −H_ij (k̂_i·k̂_j) (the row's
// part of ∂L/∂β_i; Ki: the row of k̂k̂ᵀ); H_ij = 0 from the diagonal on, and the score row P_i's
// cotangent zeroed above it (j > i). Shared by the delta rule's and KDA's backward.
template <typename Acc>
inline Acc ungated_cotangent_row(Acc* __restrict__ Hi, Acc* __restrict__ dPi, const Acc* __restrict__ Ki, Acc bi,
                                 int i, int c) {
  Acc sb = 0;
#pragma omp simd reduction(+ : sb)
  for (int j = 0; j < i; ++j) {
    const Acc da = -Hi[j];
    sb += da * Ki[j];
    Hi[j] = da * bi;
  }
  for (int j = i; j < c; ++j) Hi[j] = Acc(0);
  for (int j = i + 1; j < c; ++j) dPi[j] = Acc(0);
  return sb;
}

}  // namespace
