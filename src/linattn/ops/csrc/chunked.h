// What the fused chunked linear-attention kernels share (chunked.cpp: causal linear attention,
// gated.cpp and gated_backward.cpp: its gated form): the elementwise pieces of both chunk loops,
// compiled for AVX-512 / AVX2 where the CPU has them (the rest of each file is built for the baseline
// ISA), bf16 gemm operands, φ of a block, what a training forward saves, the block size and the input
// checks. T is the dtype of q, k, v, o; Acc that of the scores and the state (float for bf16); M that
// of the gemm operands: T, or float for bf16 inputs on the fp32 path (`with_operands`).
// Everything here has internal linkage (one copy per file).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "blas.h"
#include "common.h"

namespace {

// A (c×c, row-major) loses its part above the diagonal
template <typename Acc>
LINATTN_CLONES void mask_upper(Acc* __restrict__ A, int c) {
  for (int i = 0; i < c; ++i)
    for (int j = i + 1; j < c; ++j) A[int64_t(i) * c + j] = Acc(0);
}

// U /= den row by row (c rows of E)
template <typename Acc>
LINATTN_CLONES void divide_rows(Acc* __restrict__ U, const Acc* __restrict__ den, int c, int64_t E) {
  for (int i = 0; i < c; ++i) {
    const Acc inv = Acc(1) / den[i];
    for (int64_t x = 0; x < E; ++x) U[i * E + x] *= inv;
  }
}

// out = U / den row by row, rounded to bf16 (c rows of E): divide_rows and narrow_bf16 in one pass
LINATTN_CLONES void divide_rows_to_bf16(const float* __restrict__ U, const float* __restrict__ den, at::BFloat16* out,
                                        int c, int64_t E) {
  uint16_t* __restrict__ o = reinterpret_cast<uint16_t*>(out);
  for (int i = 0; i < c; ++i) {
    const float inv = 1.0f / den[i];
    for (int64_t x = 0; x < E; ++x) o[i * E + x] = bf16_bits(U[i * E + x] * inv);
  }
}

// z += K̃ᵀ 1 over the c rows of a chunk
template <typename T, typename Acc>
LINATTN_CLONES void add_column_sums(Acc* __restrict__ z, const T* __restrict__ K, int c, int64_t F) {
  for (int i = 0; i < c; ++i)
    for (int64_t x = 0; x < F; ++x) z[x] += static_cast<Acc>(K[i * F + x]);
}

// Backward pieces. G = ∂L/∂U = dO / den and g = ∂L/∂den = -Σ_e dO ⊙ O / den, per row of a chunk
template <typename T, typename Acc>
LINATTN_CLONES void output_grads(const T* __restrict__ dO, const T* __restrict__ O, const Acc* __restrict__ den,
                                 bool normalize, Acc* __restrict__ G, Acc* __restrict__ g, int c, int64_t E) {
  for (int i = 0; i < c; ++i) {
    const Acc inv = normalize ? Acc(1) / den[i] : Acc(1);
    Acc dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t x = 0; x < E; ++x) {
      const Acc d = static_cast<Acc>(dO[i * E + x]);
      G[i * E + x] = d * inv;
      dot += d * static_cast<Acc>(O[i * E + x]);
    }
    g[i] = -dot * inv;
  }
}

// P_ij += g_i (the denominator's share, P_d = M ⊙ g1ᵀ) on and below the diagonal, 0 above
template <typename Acc>
LINATTN_CLONES void add_rows_and_mask(Acc* __restrict__ P, const Acc* __restrict__ g, int c) {
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ Pi = P + int64_t(i) * c;
    for (int j = 0; j <= i; ++j) Pi[j] += g[i];
    for (int j = i + 1; j < c; ++j) Pi[j] = Acc(0);
  }
}

// X_i += a_i · y (a = nullptr: a_i = 1) for the c rows of X (c×F)
template <typename Acc>
LINATTN_CLONES void add_outer(Acc* __restrict__ X, const Acc* __restrict__ a, const Acc* __restrict__ y, int c,
                              int64_t F) {
  for (int i = 0; i < c; ++i) {
    const Acc ai = a == nullptr ? Acc(1) : a[i];
    for (int64_t x = 0; x < F; ++x) X[i * F + x] += ai * y[x];
  }
}

// y += Σ_i a_i X_i over the c rows of X (c×F)
template <typename T, typename Acc>
LINATTN_CLONES void add_weighted_rows(Acc* __restrict__ y, const Acc* __restrict__ a, const T* __restrict__ X, int c,
                                      int64_t F) {
  for (int i = 0; i < c; ++i)
    for (int64_t x = 0; x < F; ++x) y[x] += a[i] * static_cast<Acc>(X[i * F + x]);
}

// ∂L/∂x = ∂L/∂φ(x) · φ'(x) with φ'(x) = min(φ(x), 1) for elu+1 (f its features), or ∂L/∂x = ∂L/∂φ
// (f = nullptr: the identity)
template <typename T, typename Acc>
LINATTN_CLONES void chain_features(const Acc* __restrict__ grad, const Acc* __restrict__ f, T* __restrict__ out,
                                   int64_t n) {
  if (f == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(grad[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(grad[i] * std::min(f[i], Acc(1)));
  }
}

// n values of src as gemm operands of type M: src itself when the types agree, else a copy in buf, rounded
// to bf16 (Acc = float values as bf16 operands) or widened to float (bf16 inputs on the fp32 path)
template <typename M, typename From>
inline const M* as_operand(const From* src, Aligned<M>& buf, int64_t n) {
  if constexpr (std::is_same<M, From>::value) {
    return src;
  } else {
    if constexpr (std::is_same<M, float>::value) {
      widen_bf16(src, buf.data(), n);
    } else {
      narrow_bf16(src, buf.data(), n);
    }
    return buf.data();
  }
}

// The features φ = elu + 1 of one block of n values of q and of k, as T (bf16: rounded once, as
// they are gemm operands, and z sums the rounded values); *Q, *K point into feat.
template <typename T, typename Acc>
void block_features(const T* q, const T* k, int64_t n, Aligned<Acc>& wide, Aligned<T>& feat, const T** Q,
                    const T** K) {
  if constexpr (std::is_same<T, Acc>::value) {
    elu_plus_one(q, feat.data(), n);
    elu_plus_one(k, feat.data() + n, n);
  } else {
    // widened first: in one loop with the 16-bit loads GCC vectorizes φ 8 floats wide, not 16
    widen_bf16(q, wide.data(), n);
    widen_bf16(k, wide.data() + n, n);
    elu_plus_one(wide.data(), wide.data(), 2 * n);
    narrow_bf16(wide.data(), feat.data(), 2 * n);
  }
  *Q = feat.data();
  *K = feat.data() + n;
}

// n bf16 values widened to float, and with phi == 1 mapped by φ = elu + 1, in tiles of 1024 (4 KiB of
// floats) so that φ reads each tile from L1 right after the widening wrote it: a second pass over the
// whole block (256 KiB for q and k at 512 tokens × 64) cost the fp32 path ~2% of the forward
inline void widen_features(const at::BFloat16* src, float* dst, int64_t n, int64_t phi) {
  constexpr int64_t tile = 1024;
  for (int64_t i = 0; i < n; i += tile) {
    const int64_t len = std::min(tile, n - i);
    widen_bf16(src + i, dst + i, len);
    if (phi == 1) elu_plus_one(dst + i, dst + i, len);
  }
}

// While the chunk of tokens [t0, t1) of a row (starting at element row0 of q, k, v, o) is computed, the
// next chunk's rows of q, k, v and o are queued to be hinted into cache as the chunk's products run
// (prefetch.h); the chunk loops compute each chunk's features as it starts, from these rows
template <typename T>
inline void prefetch_ahead(const T* q, const T* k, const T* v, const T* o, int64_t row0, int64_t t0, int64_t t1,
                           int64_t N, int64_t F, int64_t E) {
  prefetch_queue().flush();
  if (t1 >= N) return;
  const int64_t n = std::min(t1 - t0, N - t1), b = int64_t(sizeof(T));
  prefetch_soon(q + (row0 + t1) * F, n * F * b);
  prefetch_soon(k + (row0 + t1) * F, n * F * b);
  prefetch_soon(v + (row0 + t1) * E, n * E * b);
  prefetch_soon(o + (row0 + t1) * E, n * E * b, true);
}

// The features of one block of a row, for inputs of type T and gemm operands of type M (T, or float
// for bf16 inputs on the fp32 path): M operands for the gemms (Q, K) and the same values as Acc (Qa,
// Ka; bf16 operands: the rounded operands widened) for the elementwise work; fQ, fK: φ(x) unrounded
// for φ' (nullptr with the identity). On the fp32 path the block is widened here, in cache, and
// nothing is rounded: Q = Qa = fQ.
template <typename T, typename M = T>
struct BlockFeatures {
  using Acc = linattn_acc<T>;
  static constexpr bool low = !std::is_same<M, Acc>::value;  // bf16 gemm operands
  static constexpr bool widen = !std::is_same<T, M>::value;  // bf16 inputs, fp32 gemm operands
  Aligned<Acc> wide, acc;
  Aligned<M> feat;
  const M *Q = nullptr, *K = nullptr;
  const Acc *Qa = nullptr, *Ka = nullptr, *fQ = nullptr, *fK = nullptr;

  BlockFeatures(int64_t phi, int64_t block, int64_t F)
      : wide(phi == 1 || widen ? 2 * block * F : 0), acc(low ? 2 * block * F : 0), feat(phi == 1 && low ? 2 * block * F : 0) {}

  void compute(const T* q, const T* k, int64_t n, int64_t phi) {
    if constexpr (widen) {
      widen_features(q, wide.data(), n, phi);
      widen_features(k, wide.data() + n, n, phi);
      Q = Qa = wide.data();
      K = Ka = wide.data() + n;
      fQ = phi == 1 ? Q : nullptr;
      fK = phi == 1 ? K : nullptr;
    } else {
      Q = q;
      K = k;
      if (phi == 1) {
        if constexpr (low) {
          block_features(q, k, n, wide, feat, &Q, &K);
        } else {
          block_features(q, k, n, wide, wide, &Q, &K);
        }
        fQ = wide.data();
        fK = wide.data() + n;
      }
      if constexpr (low) {
        widen_bf16(Q, acc.data(), n);
        widen_bf16(K, acc.data() + n, n);
        Qa = acc.data();
        Ka = acc.data() + n;
      } else {
        Qa = Q;
        Ka = K;
      }
    }
  }
};

// Calls f(M{}) with M the gemm operand type for inputs of type T: float for bf16 inputs when `wide`
// (the fp32 path: blocks widened in cache, fp32 gemms, outputs rounded once), else T itself.
template <typename T, typename Fn>
void with_operands(bool wide, Fn&& f) {
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    if (wide) {
      f(float{});
      return;
    }
  }
  f(T{});
}

// What a training forward keeps for its backward: the denominators d + ε of every token and the
// state entering every block.
template <typename Acc>
struct Saves {
  Acc* den;       // (rows, N)
  Acc* S_blocks;  // (rows, blocks, F, E)
  Acc* z_blocks;  // (rows, blocks, F)
  int64_t blocks;
};

// Tokens per block of a row: φ is computed for a block at a time, and the training forward saves the
// state entering each block (the backward recomputes the chunk states inside a block from it).
int64_t block_tokens(int64_t chunk) { return std::max<int64_t>(chunk, (512 / chunk) * chunk); }

// a·b of sizes, refused where int64 cannot hold it
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  TORCH_CHECK(!__builtin_mul_overflow(a, b, &r), "linattn_cpu: sizes overflow int64 (", a, " x ", b, ")");
  return r;
}

// q, k (B, H, N, F), v (B, H, N, E) of one dtype, states (kv-like, z-like) in the state dtype (float32
// for bf16 inputs, else q's), a BLAS gemm for the operands (bf16 ones, or fp32 ones when wide): the
// checks shared by both passes. Returns the chunk clamped to N (a larger one is the same single
// chunk), after checking that every work-buffer size fits int64 and every gemm dimension an int.
int64_t check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
                     const at::Tensor& z, int64_t phi, int64_t chunk, bool wide) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              op, " expects q, k (B, H, N, F) and v (B, H, N, E)");
  TORCH_CHECK(phi == 0 || phi == 1, op, ": phi must be 0 (identity) or 1 (elu + 1)");
  TORCH_CHECK(chunk > 0, op, ": chunk must be positive");
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3);
  TORCH_CHECK(F > 0 && E > 0, op, ": F and E must be positive, got ", F, " and ", E);
  chunk = std::min(chunk, std::max<int64_t>(N, 1));
  const int64_t block = block_tokens(chunk), most = std::numeric_limits<int>::max();
  TORCH_CHECK(chunk <= most && F <= most && E <= most, op, ": chunk, F and E must fit an int (BLAS)");
  checked_mul(checked_mul(chunk, chunk), 8);
  checked_mul(checked_mul(2 * block, F), 8);
  checked_mul(checked_mul(checked_mul(block / chunk, F), E), 8);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": q, k, v must share a dtype");
  }
  for (const at::Tensor* t : {&kv, &z}) {
    TORCH_CHECK(t->scalar_type() == (bf16 ? at::kFloat : q.scalar_type()), op,
                ": the state must be float32 for bf16 inputs, else of q's dtype");
  }
  TORCH_CHECK(bf16 && !wide ? has_blas_bf16() : has_blas(), op, ": no BLAS gemm found in torch");
  return chunk;
}

}  // namespace
