// int8 × int8 matrix-vector products for decoding with dynamically quantized activations: torchao's
// Int8DynamicActivationInt8WeightConfig (symmetric, per-row or per-tensor activation scales), computed
// as torchao computes it on a CPU (Int8Tensor's F.linear, `int_scaled_matmul`), to the bit:
//
//   activations   m = max_i |x_i| over a row (per row) or over every row (per tensor),
//                 s_x = max(m / 127.5, FLT_EPSILON),  q_i = clamp(round_half_even(x_i · (1 / s_x)), −128, 127)
//   product       c_j = Σ_i q_i w_ji           (int32, exact; w_ji the int8 weights)
//   output        y_j = (float(c_j) · s_x) · s_j  (s_j the weight's scale; the caller adds the bias)
//
// The sums run on AVX512-VNNI's vpdpbusd (unsigned × signed bytes, four products a 32-bit lane), as
// torchao's u8s8 path does: q + 128 as unsigned bytes, then c_j = Σ_i (q_i + 128) w_ji − 128 Σ_i w_ji,
// with the weights' sums Σ_i w_ji computed once per plan (`weight_sums`). Without VNNI (or with
// LINATTN_INT8_KERNEL=portable, which the tests compare) plain integer loops compute the same c_j.
//
// Layouts as in matvec.h: kn (Wt, K × N row-major) or nk (W, N × K row-major). The nk kernel runs
// vpdpbusd along a weight row; the kn one interleaves four weight rows (k, k+1, k+2, k+3) byte by byte
// with two rounds of unpacks, so that each 32-bit lane holds the four weights of one output column, in
// a fixed order of the columns that the stores undo. Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define LINATTN_VNNI 1
#endif

namespace {

// x (B × K, row-major) -> xq = q + 128 (B × K bytes) and the scales sx (B); act: 1 per row, 2 per tensor
inline void quantize_activations(const float* x, int64_t B, int64_t K, int act, uint8_t* xq, float* sx) {
  float all = 0.0f;
  for (int64_t b = 0; b < B; ++b) {
    float m = 0.0f;
    for (int64_t i = 0; i < K; ++i) m = std::max(m, std::fabs(x[b * K + i]));
    sx[b] = m;
    all = std::max(all, m);
  }
  for (int64_t b = 0; b < B; ++b) {
    const float m = act == 2 ? all : sx[b];
    const float s = std::max(m / 127.5f, FLT_EPSILON);
    const float inv = 1.0f / s;
    sx[b] = s;
    for (int64_t i = 0; i < K; ++i) {
      const float q = std::nearbyint(x[b * K + i] * inv);
      xq[b * K + i] = static_cast<uint8_t>(static_cast<int>(std::min(127.0f, std::max(-128.0f, q))) + 128);
    }
  }
}

// Σ_i w_ji for every output column j (N int32)
inline at::Tensor weight_sums(const at::Tensor& w, bool kn) {
  return w.sum(kn ? 0 : 1, /*keepdim=*/false, at::kInt).contiguous();
}

// c[b·ldc + j − j0] = Σ_i (xq_bi − 128) w_ji, portable
inline void dynamic_portable(const int8_t* w, bool kn, int64_t K, int64_t N, const uint8_t* xq, int64_t B, int32_t* c,
                             int64_t ldc, int64_t j0, int64_t j1) {
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* xb = xq + b * K;
    for (int64_t j = j0; j < j1; ++j) {
      int32_t s = 0;
      if (kn) {
        for (int64_t i = 0; i < K; ++i) s += (static_cast<int32_t>(xb[i]) - 128) * w[i * N + j];
      } else {
        for (int64_t i = 0; i < K; ++i) s += (static_cast<int32_t>(xb[i]) - 128) * w[j * K + i];
      }
      c[b * ldc + (j - j0)] = s;
    }
  }
}

#ifdef LINATTN_VNNI
#define LINATTN_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

// nk at B = 1: one weight row at a time, read as one stream with two sums along it. Four rows at a
// time (below, for batches) read 31-34 GB/s from memory on one AMD EPYC core, one row 43-44 GB/s
// (1024 × 4096 int8 matrices, 230 MB)
LINATTN_VNNI_TARGET void dynamic_row_vnni(const int8_t* W, int64_t K, const uint8_t* x, int32_t* c, int64_t j0,
                                          int64_t j1) {
  const int64_t kv = K / 64 * 64;
  const __mmask64 tail = K > kv ? (~0ULL >> (64 - (K - kv))) : 0;
  for (int64_t j = j0; j < j1; ++j) {
    const int8_t* w = W + j * K;
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 128 <= kv; i += 128) {
      a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(x + i), _mm512_loadu_si512(w + i));
      a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(x + i + 64), _mm512_loadu_si512(w + i + 64));
    }
    if (i < kv) a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(x + i), _mm512_loadu_si512(w + i));
    if (tail) a1 = _mm512_dpbusd_epi32(a1, _mm512_maskz_loadu_epi8(tail, x + kv), _mm512_maskz_loadu_epi8(tail, w + kv));
    c[j - j0] = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
  }
}

// nk: c = Σ_i xq_bi w_ji (unsigned × signed; the caller subtracts 128 Σ_i w_ji), four weight rows at a time
LINATTN_VNNI_TARGET void dynamic_nk_vnni(const int8_t* W, int64_t K, const uint8_t* xq, int64_t B, int32_t* c,
                                         int64_t ldc, int64_t j0, int64_t j1) {
  if (B == 1) {
    dynamic_row_vnni(W, K, xq, c, j0, j1);
    return;
  }
  const int64_t kv = K / 64 * 64;
  const __mmask64 tail = K > kv ? (~0ULL >> (64 - (K - kv))) : 0;
  int64_t j = j0;
  for (; j < j1; j += 4) {
    const int rows = static_cast<int>(std::min<int64_t>(4, j1 - j));
    for (int64_t b = 0; b < B; ++b) {
      const uint8_t* xb = xq + b * K;
      __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int64_t i = 0; i < kv; i += 64) {
        const __m512i x = _mm512_loadu_si512(xb + i);
        for (int r = 0; r < rows; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], x, _mm512_loadu_si512(W + (j + r) * K + i));
      }
      if (tail) {
        const __m512i x = _mm512_maskz_loadu_epi8(tail, xb + kv);
        for (int r = 0; r < rows; ++r)
          acc[r] = _mm512_dpbusd_epi32(acc[r], x, _mm512_maskz_loadu_epi8(tail, W + (j + r) * K + kv));
      }
      for (int r = 0; r < rows; ++r) c[b * ldc + (j + r - j0)] = _mm512_reduce_add_epi32(acc[r]);
    }
  }
}

// the four weight rows k..k+3 of 64 columns, interleaved: lane L's dword d of out[t] holds the four
// weights of column 16L + 4t + d (rows beyond `rows` read as zeros, columns beyond `cols` too)
LINATTN_VNNI_TARGET inline void interleave4(const int8_t* Wt, int64_t N, int rows, __mmask64 cols, __m512i out[4]) {
  __m512i a[4];
  if (rows == 4 && cols == ~0ULL) {
    for (int r = 0; r < 4; ++r) a[r] = _mm512_loadu_si512(Wt + r * N);
  } else {
    for (int r = 0; r < 4; ++r) a[r] = r < rows ? _mm512_maskz_loadu_epi8(cols, Wt + r * N) : _mm512_setzero_si512();
  }
  const __m512i t0 = _mm512_unpacklo_epi8(a[0], a[1]), t1 = _mm512_unpackhi_epi8(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi8(a[2], a[3]), t3 = _mm512_unpackhi_epi8(a[2], a[3]);
  out[0] = _mm512_unpacklo_epi16(t0, t2);
  out[1] = _mm512_unpackhi_epi16(t0, t2);
  out[2] = _mm512_unpacklo_epi16(t1, t3);
  out[3] = _mm512_unpackhi_epi16(t1, t3);
}

// kn: the same sums over Wt (K × N). As matvec.h's kn kernel: a panel of columns keeps its partial
// sums in L1 (int32, in the interleaved column order) while the weight rows stream by, four at a time;
// up to four batch rows share each interleaved weight vector.
constexpr int64_t kDynamicSums = 4096;  // int32 partial sums of a panel (all batch rows): 16 KiB

LINATTN_VNNI_TARGET void dynamic_kn_vnni(const int8_t* Wt, int64_t K, int64_t N, const uint8_t* xq, int64_t B,
                                         int32_t* c, int64_t ldc, int64_t j0, int64_t j1) {
  alignas(64) int32_t sums[kDynamicSums];
  for (int64_t b0 = 0; b0 < B; b0 += 4) {
    const int bb = static_cast<int>(std::min<int64_t>(4, B - b0));
    const int64_t panel = kDynamicSums / bb / 64 * 64;
    int32_t* acc[4] = {sums, sums + panel, sums + 2 * panel, sums + 3 * panel};
    for (int64_t p0 = j0; p0 < j1; p0 += panel) {
      const int64_t p1 = std::min(j1, p0 + panel);
      for (int b = 0; b < bb; ++b) std::fill(acc[b], acc[b] + panel, 0);
      // 8 weight rows at a time, their sums in registers (rows a power of two apart share an L1 set, and
      // L1 has 8 ways: 16 rows at a time thrashed it)
      for (int64_t i0 = 0; i0 < K; i0 += 8) {
        const int quads = static_cast<int>((std::min<int64_t>(8, K - i0) + 3) / 4);
        __m512i x[2][4];
        for (int u = 0; u < quads; ++u) {
          const int64_t i = i0 + 4 * u;
          const int rows = static_cast<int>(std::min<int64_t>(4, K - i));
          for (int b = 0; b < bb; ++b) {
            uint32_t quad = 0;
            std::memcpy(&quad, xq + (b0 + b) * K + i, static_cast<size_t>(rows));  // missing rows: 0 · 0
            x[u][b] = _mm512_set1_epi32(static_cast<int>(quad));
          }
        }
        for (int64_t j = p0; j < p1; j += 64) {
          const __mmask64 cols = ~0ULL >> (64 - std::min<int64_t>(64, p1 - j));
          __m512i a[4][4];
          for (int b = 0; b < bb; ++b)
            for (int t = 0; t < 4; ++t) a[b][t] = _mm512_load_si512(acc[b] + (j - p0) + 16 * t);
          for (int u = 0; u < quads; ++u) {
            const int64_t i = i0 + 4 * u;
            __m512i w[4];
            interleave4(Wt + i * N + j, N, static_cast<int>(std::min<int64_t>(4, K - i)), cols, w);
            for (int b = 0; b < bb; ++b)
              for (int t = 0; t < 4; ++t) a[b][t] = _mm512_dpbusd_epi32(a[b][t], x[u][b], w[t]);
          }
          for (int b = 0; b < bb; ++b)
            for (int t = 0; t < 4; ++t) _mm512_store_si512(acc[b] + (j - p0) + 16 * t, a[b][t]);
        }
      }
      for (int b = 0; b < bb; ++b) {  // undo the interleaved order: block lane 4L + d of part t is column 16L + 4t + d
        int32_t* cb = c + (b0 + b) * ldc + (p0 - j0);
        for (int64_t j = 0; j < p1 - p0; j += 64) {
          const int32_t* a = acc[b] + j;
          for (int t = 0; t < 4; ++t)
            for (int L = 0; L < 4; ++L)
              for (int d = 0; d < 4; ++d) {
                const int64_t col = j + 16 * L + 4 * t + d;
                if (col < p1 - p0) cb[col] = a[16 * t + 4 * L + d];
              }
        }
      }
    }
  }
}

inline bool dynamic_vnni() {
  static const bool use = [] {
    const char* env = std::getenv("LINATTN_INT8_KERNEL");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni") && !(env != nullptr && std::strcmp(env, "portable") == 0);
  }();
  return use;
}
#endif

// y[b·ldy + j − j0] = (float(c_bj) · s_x,b) · s_j for b < B, j in [j0, j1): the product of x (B × K
// floats) with int8 weights w (layout kn or nk, K × N) and weight scales s, x quantized per row
// (act 1) or per tensor (act 2); wsum: Σ_i w_ji (weight_sums)
inline void matvec_dynamic(const int8_t* w, bool kn, int64_t K, int64_t N, const float* s, const int32_t* wsum, int act,
                           const float* x, int64_t B, float* y, int64_t ldy, int64_t j0, int64_t j1) {
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> sx;
  thread_local std::vector<int32_t> c;
  xq.resize(static_cast<size_t>(B * K));
  sx.resize(static_cast<size_t>(B));
  c.resize(static_cast<size_t>(B * (j1 - j0)));
  quantize_activations(x, B, K, act, xq.data(), sx.data());
  const int64_t ldc = j1 - j0;
  bool biased = false;  // the sums are of q + 128: subtract 128 Σ_i w_ji
#ifdef LINATTN_VNNI
  if (dynamic_vnni()) {
    if (kn) {
      dynamic_kn_vnni(w, K, N, xq.data(), B, c.data(), ldc, j0, j1);
    } else {
      dynamic_nk_vnni(w, K, xq.data(), B, c.data(), ldc, j0, j1);
    }
    biased = true;
  }
#endif
  if (!biased) dynamic_portable(w, kn, K, N, xq.data(), B, c.data(), ldc, j0, j1);
  for (int64_t b = 0; b < B; ++b) {
    float* yb = y + b * ldy - j0;
    const int32_t* cb = c.data() + b * ldc - j0;
    for (int64_t j = j0; j < j1; ++j) {
      const int32_t sum = biased ? cb[j] - 128 * wsum[j] : cb[j];
      yb[j] = static_cast<float>(sum) * sx[b] * s[j];
    }
  }
}

}  // namespace
