// Shared by the fused CPU kernels (decode.cpp, chunked.cpp, gated.cpp, gated_backward.cpp, delta.cpp):
// the ISA clones of elementwise loops, φ = elu + 1 with an exp of its own, bf16 widening and rounding,
// aligned work buffers. Everything here has internal linkage (one copy per file).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "prefetch.h"

namespace {

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define LINATTN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LINATTN_CLONES
#endif

// exp(x) for x ≤ 0 without a library call, so that the loop calling it vectorizes: x = n ln2 + r,
// |r| ≤ ln2/2 (ln2 split in a part exact in Acc and a remainder); eʳ by its Taylor polynomial, of
// degree 7 for float and 13 for double (the remainder r^(d+1)/(d+1)! is then under 2⁻²⁷ and 2⁻⁵⁷),
// in Horner form; 2ⁿ through the exponent bits. Below the smallest normal it gives ≈ the smallest normal.
template <typename Acc>
inline Acc exp_nonpositive(Acc x) {
  constexpr bool single = std::is_same<Acc, float>::value;
  using Bits = typename std::conditional<single, int32_t, int64_t>::type;
  constexpr int mant = single ? 23 : 52, bias = single ? 127 : 1023, degree = single ? 7 : 13;
  constexpr Acc lowest = single ? Acc(-87.33654f) : Acc(-708.396418532264);  // ≈ ln of the smallest normal
  constexpr Acc log2e = Acc(1.4426950408889634), ln2_hi = single ? Acc(0.693145751953125) : Acc(0.6931471803691238);
  constexpr Acc ln2_lo = single ? Acc(1.428606765330187e-06) : Acc(1.9082149292705877e-10);
  constexpr double inv_fact[14] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                   1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600,
                                   1.0 / 6227020800.0};
  const Acc xc = std::max(x, lowest);
  constexpr Acc round = single ? Acc(12582912.0) : Acc(6755399441055744.0);  // 1.5·2^mant: adding it rounds
  const Acc n = (xc * log2e + round) - round;
  const Acc r = (xc - n * ln2_hi) - n * ln2_lo;
  Acc p = Acc(inv_fact[degree]);
  for (int d = degree - 1; d >= 0; --d) p = p * r + Acc(inv_fact[d]);
  const Bits e = (static_cast<Bits>(n) + bias) << mant;
  Acc scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// 1 where the gate x is not a finite log-decay ≤ 0 (NaN, +∞, −∞ or a positive value), else 0: OR-ed
// into the loops that read the gates (it vectorizes there)
template <typename Acc>
inline int invalid_gate(Acc x) {
  return !(x <= Acc(0) && x >= std::numeric_limits<Acc>::lowest());
}

// True where every one of the n gates is a finite log-decay ≤ 0
template <typename Acc>
LINATTN_CLONES bool gates_valid(const Acc* __restrict__ g, int64_t n) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t x = 0; x < n; ++x) bad |= invalid_gate(g[x]);
  return bad == 0;
}

// Raises a ValueError (`message` followed by the value) at the first of g's values (contiguous) that
// is not a finite log-decay ≤ 0: where a kernel that checks the gates as it reads them found one
inline void raise_invalid_gate(const at::Tensor& g, const char* message) {
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "linattn_cpu_invalid_gate", [&] {
    const scalar_t* p = g.data_ptr<scalar_t>();
    for (int64_t i = 0; i < g.numel(); ++i) TORCH_CHECK_VALUE(gates_valid(p + i, 1), message, p[i]);
  });
}

// φ = elu + 1 = exp(min(x, 0)) + max(x, 0) of n values, in Acc
template <typename T, typename Acc>
LINATTN_CLONES void elu_plus_one(const T* x, Acc* out, int64_t n) {
#pragma omp simd  // out = x is allowed: element i reads and writes only index i
  for (int64_t i = 0; i < n; ++i) {
    const Acc v = static_cast<Acc>(x[i]);
    out[i] = exp_nonpositive(std::min(v, Acc(0))) + std::max(v, Acc(0));
  }
}

// bf16 -> float (exact: the bf16 bits are the float's upper half)
LINATTN_CLONES void widen_bf16(const at::BFloat16* __restrict__ src, float* __restrict__ dst, int64_t n) {
  const uint16_t* __restrict__ in = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(in[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}

// The bits of x rounded to bf16, to nearest even (NaN stays NaN), written so that loops calling it
// vectorize
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
}

// float -> bf16 of n values
LINATTN_CLONES void narrow_bf16(const float* __restrict__ src, at::BFloat16* __restrict__ dst, int64_t n) {
  uint16_t* __restrict__ out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(src[i]);
}

// The dtype of a step's inputs (q, k, v): the state's (kv's), or bf16 on a float32 state (the
// step widens them); checked to be one of these and shared by all
inline at::ScalarType input_dtype(const char* op, const at::Tensor& kv, std::initializer_list<const at::Tensor*> xs) {
  const at::ScalarType io = (*xs.begin())->scalar_type();
  TORCH_CHECK(io == kv.scalar_type() || (io == at::kBFloat16 && kv.scalar_type() == at::kFloat), op,
              ": q, k, v must have the state's dtype, or be bf16 on a float32 state");
  for (const at::Tensor* t : xs) TORCH_CHECK(t->scalar_type() == io, op, ": q, k, v must share a dtype");
  return io;
}

// A per-thread work buffer of n elements on a 64-byte boundary (a cache line, as torch aligns tensors:
// the gemm operands made here are then laid out like the ones taken from q, k, v)
template <typename X>
class Aligned {
 public:
  explicit Aligned(int64_t n) : p_(nullptr) {
    TORCH_CHECK(n >= 0 && n <= (INT64_MAX - 63) / int64_t(sizeof(X)), "linattn_cpu: a work buffer of ", n,
                " elements is too large");
    if (n > 0) p_ = static_cast<X*>(std::aligned_alloc(64, (n * sizeof(X) + 63) / 64 * 64));
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

}  // namespace
