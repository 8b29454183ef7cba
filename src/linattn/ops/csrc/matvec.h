// Matrix-vector products for decoding (model_step.cpp): y = x Wᵀ for a few rows x (the batch), with
// fp32, bf16 or int8 weights and fp32 inputs, outputs and accumulation. Decoding one token reads every
// weight once and does one multiply-add with it per batch row, so at small batches these products are
// bound by the speed at which the weights stream from memory; the kernels keep that stream sequential
// and widen bf16 and int8 weights to fp32 in registers (exact: a bf16 value is the upper half of a
// float, an int8 one a small integer; AVX-512: vpmovsxbd + vcvtdq2ps per 16 int8 weights).
//
// int8 weights are weight-only quantized (torchao's Int8Tensor, linattn.models.weights): W[j, :] =
// s_j · q[j, :] with one float scale s_j per output column j (per-row, or one for all). The kernels
// multiply-add the integers q as floats, and `matvec` scales the finished sums: y_j = s_j · Σ_i x_i q_ji,
// as torchao's weight-only F.linear computes (x · qᵀ) · s. The activations stay float. With torchao's
// dynamic activation quantization (the activations rounded to int8 too, a different model) the
// products are integer dot products instead (matvec_dynamic.h, VNNI).
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
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "matvec_dynamic.h"

namespace {

// 16 floats; GCC and clang lower these to one AVX-512 register, two AVX2 ones or four SSE ones
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int8_t v16c __attribute__((vector_size(16)));
typedef int16_t v16s __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));

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

// int8 -> int16 -> int32 -> float, one width at a time, for the ISA clones: GCC 12 lowers these to
// extensions and shuffles (a direct int8 -> float conversion, or int8 -> int32, it scalarizes); AVX-512
// machines take `Avx512Int8` below instead
LINATTN_INLINE v16f load16(const int8_t* p) {
  v16c c;
  std::memcpy(&c, p, sizeof(c));
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(c, v16s), v16i), v16f);
}

LINATTN_INLINE void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

LINATTN_INLINE float widen(float x) { return x; }
LINATTN_INLINE float widen(at::BFloat16 x) { return static_cast<float>(x); }
LINATTN_INLINE float widen(int8_t x) { return static_cast<float>(x); }

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

// Columns of the output panel kept in cache while the rows stream past: B·panel floats ≤ 64 KiB (in L2).
// Wider panels read longer runs of each weight row: 4,096 floats (16 KiB, in L1) streamed a 1024 × 51200
// fp32 matrix at 28 GB/s on one AMD EPYC core, 16,384 at 33-35 GB/s (a plain sum over it: 37-42 GB/s)
inline int64_t panel_columns(int64_t batch) { return std::max<int64_t>(16, (16384 / std::max<int64_t>(batch, 1)) / 16 * 16); }

// How the kernels widen 16 weights to 16 floats: GCC's vector extensions (every ISA clone), or, for
// int8 on AVX-512, vpmovsxbd + vcvtdq2ps (`Avx512Int8`, below)
struct VecLoad {
  template <typename W>
  static LINATTN_INLINE v16f load(const W* p) { return load16(p); }
};

// y[b·ldy + j − j0] = Σ_i x[b·ldx + i] Wt[i·ldw + j] for b < B, j in [j0, j1). Rows are taken R at a
// time: each group of R weight vectors is loaded once and used for every batch row, and the partial
// sums of a panel of columns stay in cache while the weight rows stream sequentially.
// R = 8 rows for batches (each weight vector serves B rows), 4 at B = 1: fewer concurrent streams read
// faster from memory (one AMD EPYC core, 1024 × 6144 fp32 matrices, 230 MB: 37-43 GB/s with 4 rows,
// 34-37 with 8), and one partial-sum load and store per four weight vectors still keeps up.
template <typename W, typename L, int R>
LINATTN_INLINE void matvec_kn_rows(const W* __restrict__ Wt, int64_t ldw, int64_t K, const float* __restrict__ x,
                                   int64_t ldx, int64_t B, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
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
        for (int r = 0; r < R; ++r) w[r] = L::load(row + r * ldw + j);
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
        for (int64_t j = p0; j < vec_end; j += 16) store16(yb + (j - p0), load16(yb + (j - p0)) + xi * L::load(row + j));
        for (int64_t j = vec_end; j < p1; ++j) yb[j - p0] += xi * widen(row[j]);
      }
    }
  }
}

template <typename W, typename L>
LINATTN_INLINE void matvec_kn_body(const W* __restrict__ Wt, int64_t ldw, int64_t K, const float* __restrict__ x,
                                   int64_t ldx, int64_t B, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  if (B == 1) {
    matvec_kn_rows<W, L, 4>(Wt, ldw, K, x, ldx, B, y, ldy, j0, j1);
  } else {
    matvec_kn_rows<W, L, 8>(Wt, ldw, K, x, ldx, B, y, ldy, j0, j1);
  }
}

template <typename W>
LINATTN_CLONES void matvec_kn(const W* __restrict__ Wt, int64_t ldw, int64_t K, const float* __restrict__ x,
                              int64_t ldx, int64_t B, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  matvec_kn_body<W, VecLoad>(Wt, ldw, K, x, ldx, B, y, ldy, j0, j1);
}

// BB batch rows × JR output rows j, j + 1, …: y[b·ldy + r] = W[(j + r)·ldw + :] · x[b·ldx + :]
template <typename W, typename L, int BB, int JR>
LINATTN_INLINE void dot_tile(const W* __restrict__ Wr, int64_t ldw, int64_t K, const float* __restrict__ x, int64_t ldx,
                     float* __restrict__ y, int64_t ldy, int64_t j) {
  v16f acc[BB][JR];
  for (int b = 0; b < BB; ++b)
    for (int r = 0; r < JR; ++r) acc[b][r] = v16f{};
  const int64_t kv = K / 16 * 16;
  for (int64_t i = 0; i < kv; i += 16) {
    v16f w[JR];
    for (int r = 0; r < JR; ++r) w[r] = L::load(Wr + (j + r) * ldw + i);
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

// y = w · x for one weight row: the row read as one sequential stream, four accumulators along it.
// At B = 1 this beats the 4-row tiles by a fifth once the weights stream from memory: one AMD EPYC core
// read 218 MB of 4096 × 1024 fp32 matrices at 42-45 GB/s this way, at 35 GB/s four rows at a time
// (a plain sum: 44-46 GB/s)
template <typename W, typename L>
LINATTN_INLINE float dot_row(const W* __restrict__ w, int64_t K, const float* __restrict__ x) {
  v16f a0{}, a1{}, a2{}, a3{};
  int64_t i = 0;
  for (; i + 64 <= K; i += 64) {
    a0 += load16(x + i) * L::load(w + i);
    a1 += load16(x + i + 16) * L::load(w + i + 16);
    a2 += load16(x + i + 32) * L::load(w + i + 32);
    a3 += load16(x + i + 48) * L::load(w + i + 48);
  }
  for (; i + 16 <= K; i += 16) a0 += load16(x + i) * L::load(w + i);
  float s = lane_sum((a0 + a1) + (a2 + a3));
  for (; i < K; ++i) s += x[i] * widen(w[i]);
  return s;
}

template <typename W, typename L, int BB>
LINATTN_INLINE void dot_rows(const W* __restrict__ Wr, int64_t ldw, int64_t K, const float* __restrict__ x,
                             int64_t ldx, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  if constexpr (BB == 1) {
    for (int64_t j = j0; j < j1; ++j) y[j - j0] = dot_row<W, L>(Wr + j * ldw, K, x);
  } else {
    constexpr int JR = BB > 4 ? 2 : 4;  // at most 16 accumulators
    int64_t j = j0;
    for (; j + JR <= j1; j += JR) dot_tile<W, L, BB, JR>(Wr, ldw, K, x, ldx, y + (j - j0), ldy, j);
    for (; j < j1; ++j) dot_tile<W, L, BB, 1>(Wr, ldw, K, x, ldx, y + (j - j0), ldy, j);
  }
}

// y[b·ldy + j − j0] = Σ_i W[j·ldw + i] x[b·ldx + i] for b < B, j in [j0, j1): dot products of weight rows
// with up to eight batch rows at a time
template <typename W, typename L>
LINATTN_INLINE void matvec_nk_body(const W* __restrict__ Wr, int64_t ldw, int64_t K, const float* __restrict__ x,
                                   int64_t ldx, int64_t B, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  int64_t b = 0;
  for (; b + 8 <= B; b += 8) dot_rows<W, L, 8>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
  for (; b + 4 <= B; b += 4) dot_rows<W, L, 4>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
  for (; b + 2 <= B; b += 2) dot_rows<W, L, 2>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
  for (; b < B; ++b) dot_rows<W, L, 1>(Wr, ldw, K, x + b * ldx, ldx, y + b * ldy, ldy, j0, j1);
}

template <typename W>
LINATTN_CLONES void matvec_nk(const W* __restrict__ Wr, int64_t ldw, int64_t K, const float* __restrict__ x,
                              int64_t ldx, int64_t B, float* __restrict__ y, int64_t ldy, int64_t j0, int64_t j1) {
  matvec_nk_body<W, VecLoad>(Wr, ldw, K, x, ldx, B, y, ldy, j0, j1);
}

// int8 on AVX-512: the same kernels with a two-instruction widening (vpmovsxbd from memory, vcvtdq2ps)
// GCC's generic conversion of a 16-byte vector takes ten shuffles and extensions, which made the int8
// products bound by arithmetic, not by the (four times fewer) bytes they read. Chosen at run time
// (`int8_avx512`); LINATTN_INT8_KERNEL=portable keeps the generic clones (tests compare the two).
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define LINATTN_INT8_AVX512 1
// (an asm statement: an intrinsic carries the avx512f target, which GCC will not inline into the
// kernels' bodies, written for every ISA; these loads are only instantiated inside avx512f functions)
struct Avx512Int8 {
  static LINATTN_INLINE v16f load(const int8_t* p) {
    v16i i;
    asm("vpmovsxbd %1, %0" : "=v"(i) : "m"(*reinterpret_cast<const v16c*>(p)));
    return __builtin_convertvector(i, v16f);
  }
};

__attribute__((target("avx512f"))) void matvec_kn_int8_avx512(const int8_t* Wt, int64_t ldw, int64_t K, const float* x,
                                                              int64_t ldx, int64_t B, float* y, int64_t ldy, int64_t j0,
                                                              int64_t j1) {
  matvec_kn_body<int8_t, Avx512Int8>(Wt, ldw, K, x, ldx, B, y, ldy, j0, j1);
}

__attribute__((target("avx512f"))) void matvec_nk_int8_avx512(const int8_t* Wr, int64_t ldw, int64_t K, const float* x,
                                                              int64_t ldx, int64_t B, float* y, int64_t ldy, int64_t j0,
                                                              int64_t j1) {
  matvec_nk_body<int8_t, Avx512Int8>(Wr, ldw, K, x, ldx, B, y, ldy, j0, j1);
}

inline bool int8_avx512() {
  static const bool use = [] {
    const char* env = std::getenv("LINATTN_INT8_KERNEL");
    return __builtin_cpu_supports("avx512f") && !(env != nullptr && std::strcmp(env, "portable") == 0);
  }();
  return use;
}
#endif

// A weight matrix read in place: fp32 or bf16 values, or int8 values q with a float scale per output
// column (W[j, i] = s_j · q[j, i]; `scale` (N,) float32, already rounded to the model's dtype), in
// the kn layout (Wt (K × N) row-major) or the nk one (W (N × K) row-major)
struct Weights {
  at::Tensor t, scale;
  at::ScalarType type = at::kFloat;
  bool kn = true;
  int64_t K = 0, N = 0;
  const void* p = nullptr;
  const float* s = nullptr;

  Weights() = default;
  Weights(const at::Tensor& w, bool kn_layout, const at::Tensor& scales) : t(w), type(w.scalar_type()), kn(kn_layout) {
    TORCH_CHECK(w.dim() == 2, "linattn_cpu::DecodePlan: a weight must be a matrix");
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && (type == at::kFloat || type == at::kBFloat16 || type == at::kChar),
                "linattn_cpu::DecodePlan: weights must be contiguous float32, bfloat16 or int8 CPU matrices");
    K = kn ? w.size(0) : w.size(1);
    N = kn ? w.size(1) : w.size(0);
    p = w.data_ptr();
    TORCH_CHECK((type == at::kChar) == scales.defined(), "linattn_cpu::DecodePlan: int8 weights (and only they) take a scale");
    if (scales.defined()) {
      TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
                  "linattn_cpu::DecodePlan: the scale of an int8 weight must be a contiguous float32 (N=", N, ") vector");
      scale = scales;
      s = scales.data_ptr<float>();
    }
  }
  // int8 weights of torchao's dynamic activation quantization (matvec_dynamic.h): act 1 quantizes the
  // activations per row, 2 per tensor; the weights' sums are computed here, once
  int act = 0;
  at::Tensor sums;
  const int32_t* wsum = nullptr;
  void quantize_activations_too(int mode) {
    TORCH_CHECK(mode >= 0 && mode <= 2, "linattn_cpu::DecodePlan: act_quant must be 0, 1 (per row) or 2 (per tensor)");
    TORCH_CHECK(mode == 0 || type == at::kChar, "linattn_cpu::DecodePlan: only int8 weights quantize the activations");
    act = mode;
    if (act != 0) {
      sums = weight_sums(t, kn);
      wsum = sums.data_ptr<int32_t>();
    }
  }
  // bytes a product reads: the matrix and its scales
  int64_t bytes() const {
    return t.numel() * static_cast<int64_t>(t.element_size()) + (scale.defined() ? scale.numel() * 4 : 0);
  }
};

template <typename W>
LINATTN_INLINE void matvec_layout(const Weights& w, const float* x, int64_t B, float* y, int64_t ldy, int64_t j0, int64_t j1) {
  const W* p = static_cast<const W*>(w.p);
#ifdef LINATTN_INT8_AVX512
  if (std::is_same<W, int8_t>::value && int8_avx512()) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p);
    if (w.kn) {
      matvec_kn_int8_avx512(q, w.N, w.K, x, w.K, B, y, ldy, j0, j1);
    } else {
      matvec_nk_int8_avx512(q, w.K, w.K, x, w.K, B, y, ldy, j0, j1);
    }
    return;
  }
#endif
  if (w.kn) {
    matvec_kn(p, w.N, w.K, x, w.K, B, y, ldy, j0, j1);
  } else {
    matvec_nk(p, w.K, w.K, x, w.K, B, y, ldy, j0, j1);
  }
}

// y[b·ldy + j − j0] = (x_b · Wᵀ)_j for b < B, j in [j0, j1), x (B × K) row-major: the kernel of the
// weights' dtype and layout; int8 sums are then scaled, y_j ← s_j · y_j, or with a bf16 model (where
// torchao's F.linear holds bf16 tensors) y_j ← bf16(s_j · bf16(y_j))
inline void matvec(const Weights& w, const float* x, int64_t B, float* y, int64_t ldy, int64_t j0, int64_t j1, bool bf16) {
  if (w.type == at::kFloat) {
    matvec_layout<float>(w, x, B, y, ldy, j0, j1);
  } else if (w.type == at::kBFloat16) {
    matvec_layout<at::BFloat16>(w, x, B, y, ldy, j0, j1);
  } else if (w.act != 0) {
    TORCH_CHECK(!bf16, "linattn_cpu::DecodePlan: dynamic activation quantization in a bf16 model");
    matvec_dynamic(static_cast<const int8_t*>(w.p), w.kn, w.K, w.N, w.s, w.wsum, w.act, x, B, y, ldy, j0, j1);
  } else {
    matvec_layout<int8_t>(w, x, B, y, ldy, j0, j1);
    for (int64_t b = 0; b < B; ++b) {
      float* yb = y + b * ldy - j0;
      if (bf16) {
        for (int64_t j = j0; j < j1; ++j) yb[j] = round_bf16(round_bf16(yb[j]) * w.s[j]);
      } else {
        for (int64_t j = j0; j < j1; ++j) yb[j] *= w.s[j];
      }
    }
  }
}

}  // namespace
