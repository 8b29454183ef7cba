// What the fused chunked kernels share (chunked.cpp: causal linear attention, gated.cpp: its gated
// form): torch's BLAS gemm looked up at run time and held to one thread inside parallel rows, bf16
// conversions, per-thread work buffers, the elementwise pieces of both chunk loops, the input checks,
// and results taken from the buffer pool (one pool for the extension, defined in chunked.cpp).
// Everything but the pool has internal linkage (one copy per file).
#pragma once

#include <ATen/ATen.h>

#include <dlfcn.h>

#include <cstdlib>
#include <type_traits>

#include "common.h"

namespace linattn_pool {

// A result tensor of `sizes`: from the pool of reused buffers when it is 8 MiB or more (chunked.cpp)
at::Tensor empty_result(at::IntArrayRef sizes, const at::TensorOptions& opts);

// Frees the buffers the pool holds; returns their bytes
int64_t release_pool();

}  // namespace linattn_pool

namespace {

using linattn_pool::empty_result;

// A symbol of the loaded torch (its BLAS), or nullptr: global lookup first, then libtorch_cpu itself.
void* torch_symbol(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (sym == nullptr) {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib != nullptr) sym = dlsym(lib, name);
  }
  return sym;
}

// Fortran BLAS gemm, column-major: C = alpha op(A) op(B) + beta C, with In operands and Out results
// (sgemm_ / dgemm_: In = Out; MKL's gemm_bf16bf16f32_: bf16 in, float out).
template <typename In, typename Out>
using gemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const Out*, const In*,
                        const int*, const In*, const int*, const Out*, Out*, const int*);

template <typename In>
using linattn_acc = typename std::conditional<std::is_same<In, at::BFloat16>::value, float, In>::type;

// The gemm of the loaded torch for operands of type In, or nullptr (checked once).
template <typename In>
gemm_t<In, linattn_acc<In>> blas_gemm() {
  static const auto fn = reinterpret_cast<gemm_t<In, linattn_acc<In>>>(
      torch_symbol(std::is_same<In, at::BFloat16>::value ? "gemm_bf16bf16f32_"
                   : std::is_same<In, float>::value      ? "sgemm_"
                                                         : "dgemm_"));
  return fn;
}

bool has_blas() { return blas_gemm<float>() != nullptr && blas_gemm<double>() != nullptr; }

bool has_blas_bf16() { return blas_gemm<at::BFloat16>() != nullptr; }

// Holds MKL to one thread on the calling thread while alive (MKL's thread-local setting; nothing
// where torch's BLAS is not MKL). Called from inside a parallel region, MKL still sets up for
// threads of its own on every call: two threads each calling 64×64 sgemms reached ~145 GFLOP/s on
// this 2-core machine, ~205 with this guard.
class SequentialBlas {
 public:
  SequentialBlas() {
    if (set_local() != nullptr) previous_ = set_local()(1);
  }
  ~SequentialBlas() {
    if (set_local() != nullptr) set_local()(previous_);
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  using set_t = int (*)(int);
  static set_t set_local() {
    static const auto fn = reinterpret_cast<set_t>(torch_symbol("MKL_Set_Num_Threads_Local"));
    return fn;
  }
  int previous_ = 0;
};

// row-major C (M×N) = op(A) op(B) + beta·C, op(X) = Xᵀ when tX: the column-major gemm on the transposes
template <typename In, typename Out = linattn_acc<In>>
inline void gemm_rm(bool ta, bool tb, int M, int N, int K, const In* A, int lda, const In* B, int ldb, Out beta, Out* C,
                    int ldc) {
  const char tA = tb ? 'T' : 'N', tB = ta ? 'T' : 'N';
  const Out one = 1;
  blas_gemm<In>()(&tA, &tB, &N, &M, &K, &one, B, &ldb, A, &lda, &beta, C, &ldc);
}

// Elementwise pieces of the chunk loop, compiled for AVX-512 / AVX2 where the CPU has them (the rest
// of this file is built for the baseline ISA). T is the dtype of q, k, v, o; Acc that of the scores
// and the state (float for bf16).

// bf16 -> float (exact: the bf16 bits are the float's upper half)
LINATTN_CLONES void widen_bf16(const at::BFloat16* __restrict__ src, float* __restrict__ dst, int64_t n) {
  const uint16_t* __restrict__ in = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(in[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}

// float -> bf16, round to nearest even (NaN stays NaN), written so that it vectorizes
LINATTN_CLONES void narrow_bf16(const float* __restrict__ src, at::BFloat16* __restrict__ dst, int64_t n) {
  uint16_t* __restrict__ out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[i] = src[i] != src[i] ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
  }
}

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

// A per-thread work buffer of n elements on a 64-byte boundary (a cache line, as torch aligns tensors:
// the gemm operands made here are then laid out like the ones taken from q, k, v)
template <typename X>
class Aligned {
 public:
  explicit Aligned(int64_t n)
      : p_(n > 0 ? static_cast<X*>(std::aligned_alloc(64, (n * sizeof(X) + 63) / 64 * 64)) : nullptr) {
    TORCH_CHECK(n == 0 || p_ != nullptr, "linattn_cpu: out of memory for a work buffer");
  }
  ~Aligned() { std::free(p_); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  X* data() { return p_; }
  X* begin() { return p_; }

 private:
  X* p_;
};

// Acc operands as T (a copy only for bf16)
template <typename T, typename Acc>
inline const T* as_operand(const Acc* src, Aligned<T>& buf, int64_t n) {
  if constexpr (std::is_same<T, Acc>::value) {
    return src;
  } else {
    narrow_bf16(src, buf.data(), n);
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

// q, k (B, H, N, F), v (B, H, N, E) of one dtype, states (kv-like, z-like) in the state dtype (float32
// for bf16 inputs, else q's), a BLAS gemm for the dtype: the checks shared by both passes.
void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
                  const at::Tensor& z, int64_t phi, int64_t chunk) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              op, " expects q, k (B, H, N, F) and v (B, H, N, E)");
  TORCH_CHECK(phi == 0 || phi == 1, op, ": phi must be 0 (identity) or 1 (elu + 1)");
  TORCH_CHECK(chunk > 0, op, ": chunk must be positive");
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": q, k, v must share a dtype");
  }
  for (const at::Tensor* t : {&kv, &z}) {
    TORCH_CHECK(t->scalar_type() == (bf16 ? at::kFloat : q.scalar_type()), op,
                ": the state must be float32 for bf16 inputs, else of q's dtype");
  }
  TORCH_CHECK(bf16 ? has_blas_bf16() : has_blas(), op, ": no BLAS gemm found in torch");
}

}  // namespace
