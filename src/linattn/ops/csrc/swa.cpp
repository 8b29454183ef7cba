// Sliding-window softmax attention (linattn.ops.swa) as fused CPU operators: `swa_forward` and
// `swa_backward`, fp32, fp64 and bf16, one (batch, head) row per task (with cu_seqlens one (sequence, head)
// row, rows.h: no window reaches into another sequence). Query i of a row attends to the keys
// j ∈ [max(0, i − W + 1), i] of its row:
//
//   o_i = Σ_j e^{scale·q_i·k_j − lse_i} v_j,   lse_i = log Σ_j e^{scale·q_i·k_j}
//
// The queries are walked in blocks of C rows; block [i0, i0 + c) reads the keys and values
// [j0, i0 + c), j0 = max(0, i0 − W + 1), straight from k and v (no padded copy, no span tensor): at most
// C + W − 1 of them. Per block, forward: S = Q K_spanᵀ (one gemm), P = e^{scale·S − m} on each query's
// window and 0 elsewhere (set, never computed from −∞), O = P V_span / (P 1) (one gemm), lse = m + log(P 1).
// Backward (FlashAttention-2's, Dao 2023), with D_i = dO_i · O_i and P recomputed from lse:
//
//   dV_span += Pᵀ dO,  dP = dO V_spanᵀ,  dS = P ⊙ (dP − D)·scale,  dQ = dS K_span,  dK_span += dSᵀ Q
//
// five gemms, dK and dV accumulated in place over the overlapping spans of the row (one thread per
// row). Saved for the backward: o and lse (N values per row), no score matrix. The work per block is
// 2 (forward) + 5 (backward) gemms of C × (C + W − 1) × D (the span rounded up to 16 keys, `span_start`),
// the exponentials C·W each way.
//
// bf16 inputs (Acc = float): each block's q, k, v (and dO) rows are widened to float in a work buffer as
// they are read and multiplied by sgemm (MKL's bf16 gemm without AMX ran slower than its sgemm on these
// CPUs, linattn.ops.precision); scores, sums and lse stay float; o and dQ are rounded to bf16 once per
// block, dK and dV summed in float over a sliding range of the row's keys (`SlidingGrads`) and rounded as
// they leave it; D_i = Σ_j P_ij dP_ij from the float P and dP (not dO_i · O_i from the rounded o).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "blas.h"
#include "chunked.h"
#include "common.h"
#include "pool.h"
#include "rows.h"
#include "step_rows.h"

namespace {

using linattn_pool::empty_result;

// Query rows of a block and their windows in the block's key span: row ii is query i0 + ii, its window
// the span's keys [lo(ii), hi(ii)] with hi = first + ii (first = i0 − j0) and lo = max(0, hi − W + 1).
struct Windows {
  int first, window;
  int hi(int ii) const { return first + ii; }
  int lo(int ii) const { return std::max(0, first + ii - window + 1); }
};

// mx = max and mn = min of x[0 … n) (n ≥ 1; NaN ignored unless all are): 16 running lanes elementwise,
// which vectorize, then the lanes and the last n mod 16 values. (The same as an omp simd max/min
// reduction, which GCC 12 left scalar: std::max is a compare-and-select on floats, not a MAX_EXPR.)
template <typename Acc>
inline void max_min(const Acc* __restrict__ x, int n, Acc& mx, Acc& mn) {
  constexpr int kLanes = 16;
  Acc hi[kLanes], lo[kLanes];
  for (int u = 0; u < kLanes; ++u) hi[u] = -std::numeric_limits<Acc>::infinity(), lo[u] = -hi[u];
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma omp simd
    for (int u = 0; u < kLanes; ++u) {
      hi[u] = std::max(hi[u], x[j + u]);
      lo[u] = std::min(lo[u], x[j + u]);
    }
  }
  for (int u = 0; j + u < n; ++u) {
    hi[u] = std::max(hi[u], x[j + u]);
    lo[u] = std::min(lo[u], x[j + u]);
  }
  mx = hi[0], mn = lo[0];
  for (int u = 1; u < kLanes; ++u) mx = std::max(mx, hi[u]), mn = std::min(mn, lo[u]);
}

// Forward: row ii of S (c×nk) becomes P = e^{scale·S − m} on its window, 0 elsewhere; m and the row sum l
// returned per row. The max runs on the raw scores (max_min, in vector lanes), m = scale·max (scale·min
// for scale < 0), and the exponentials take scale·s − m in one pass.
template <typename Acc>
LINATTN_CLONES void softmax_rows(Acc* __restrict__ S, int c, int nk, Windows w, Acc scale, Acc* __restrict__ m,
                                 Acc* __restrict__ l) {
  for (int ii = 0; ii < c; ++ii) {
    Acc* __restrict__ s = S + int64_t(ii) * nk;
    const int lo = w.lo(ii), hi = w.hi(ii);
    Acc mx, mn;
    max_min(s + lo, hi - lo + 1, mx, mn);
    const Acc shift = scale >= Acc(0) ? scale * mx : scale * mn;
    Acc sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = lo; j <= hi; ++j) {
      s[j] = exp_nonpositive(std::min(s[j] * scale - shift, Acc(0)));
      sum += s[j];
    }
    std::fill(s, s + lo, Acc(0));
    std::fill(s + hi + 1, s + nk, Acc(0));
    m[ii] = shift;
    l[ii] = sum;
  }
}

// Backward: row ii of S becomes P = e^{scale·S − lse} on its window, 0 elsewhere
template <typename Acc>
LINATTN_CLONES void probabilities(Acc* __restrict__ S, int c, int nk, Windows w, Acc scale,
                                  const Acc* __restrict__ lse) {
  for (int ii = 0; ii < c; ++ii) {
    Acc* __restrict__ s = S + int64_t(ii) * nk;
    const int lo = w.lo(ii), hi = w.hi(ii);
    const Acc shift = lse[ii];
#pragma omp simd
    for (int j = lo; j <= hi; ++j) s[j] = exp_nonpositive(s[j] * scale - shift);
    std::fill(s, s + lo, Acc(0));
    std::fill(s + hi + 1, s + nk, Acc(0));
  }
}

// dP (c×nk) becomes dS = P ⊙ (dP − D_i)·scale on the windows (0 elsewhere: P is 0 there). D = nullptr:
// D_i = Σ_j P_ij dP_ij (= dO_i · P_i V = dO_i · O_i), from the float P and dP rather than the rounded o
template <typename Acc>
LINATTN_CLONES void score_grads(Acc* __restrict__ dP, const Acc* __restrict__ P, const Acc* __restrict__ D, int c,
                                int nk, Windows w, Acc scale) {
  for (int ii = 0; ii < c; ++ii) {
    Acc* __restrict__ d = dP + int64_t(ii) * nk;
    const Acc* __restrict__ p = P + int64_t(ii) * nk;
    const int lo = w.lo(ii), hi = w.hi(ii);
    Acc di = 0;
    if (D != nullptr) {
      di = D[ii];
    } else {
#pragma omp simd reduction(+ : di)
      for (int j = lo; j <= hi; ++j) di += p[j] * d[j];
    }
#pragma omp simd
    for (int j = lo; j <= hi; ++j) d[j] = p[j] * (d[j] - di) * scale;
    std::fill(d, d + lo, Acc(0));
    std::fill(d + hi + 1, d + nk, Acc(0));
  }
}

// O (c×E) /= l row by row, lse = m + log l; O written to out in T (bf16: rounded, out ≠ O)
template <typename T, typename Acc>
LINATTN_CLONES void finish_rows(Acc* __restrict__ O, const Acc* __restrict__ m, const Acc* __restrict__ l, int c,
                                int64_t E, T* out, Acc* __restrict__ lse) {
  for (int ii = 0; ii < c; ++ii) {
    const Acc inv = Acc(1) / l[ii];
    Acc* __restrict__ o = O + ii * E;
    if constexpr (std::is_same<T, Acc>::value) {
#pragma omp simd
      for (int64_t x = 0; x < E; ++x) o[x] *= inv;
    } else {
      uint16_t* __restrict__ ob = reinterpret_cast<uint16_t*>(out) + ii * E;
      for (int64_t x = 0; x < E; ++x) ob[x] = bf16_bits(o[x] * inv);
    }
    lse[ii] = m[ii] + std::log(l[ii]);
  }
}

// D_i = dO_i · O_i of c rows (dO already in Acc, O in T: fp32 and fp64; bf16 takes D from P and dP)
template <typename T, typename Acc>
LINATTN_CLONES void row_dots(const Acc* __restrict__ dO, const T* __restrict__ O, int c, int64_t E,
                             Acc* __restrict__ out) {
  for (int ii = 0; ii < c; ++ii) {
    Acc s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t x = 0; x < E; ++x) s += dO[ii * E + x] * static_cast<Acc>(O[ii * E + x]);
    out[ii] = s;
  }
}

// The checks of both passes: q, k (B, H, N, D), v (B, H, N, E) of one dtype, fp32, fp64 or bf16; W, C ≥ 1
void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                  int64_t chunk) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              op, " expects q, k (B, H, N, D) and v (B, H, N, E)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble || q.scalar_type() == at::kBFloat16, op,
              ": q, k, v must be fp32, fp64 or bf16");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": q, k, v must share a dtype");
  TORCH_CHECK(window >= 1 && chunk >= 1, op, ": window and chunk must be positive");
  const int64_t most = std::numeric_limits<int>::max() / 2;
  TORCH_CHECK(q.size(3) <= most && v.size(3) <= most && chunk <= most && window <= most, op,
              ": D, E, chunk and window must fit an int (BLAS)");
  TORCH_CHECK(has_blas(), op, ": no BLAS gemm found in torch");
}

// The first key of block [i0, i0 + c)'s span: its first query's window start max(0, i0 − W + 1), moved
// down so that the span's length rounds up to a multiple of 16 keys where the row has them (the extra keys'
// scores are set to 0 like the rest outside the windows). A span of 127 keys (W = C = 64) ran the Q Kᵀ gemm at
// 61 GFLOP/s, one of 128 at 74: MKL's kernels work in 16-float columns. Short spans (more than 1/8 to add) are
// left as they are.
inline int64_t span_start(int64_t i0, int c, int64_t window) {
  const int64_t j0 = std::max<int64_t>(0, i0 - window + 1), nk = i0 + c - j0, padded = (nk + 15) / 16 * 16;
  return (padded - nk) * 8 > nk ? j0 : std::max<int64_t>(0, i0 + c - padded);
}

// The work buffers' sizes for blocks of `chunk` queries on rows of at most n tokens: the longest span,
// the most queries of a block, and (bf16, `wide`) the rows of widened q and of widened k, v
struct BlockSizes {
  int64_t span, rows_most, cw, sw;
};

inline BlockSizes block_sizes(int64_t chunk, int64_t window, int64_t n, bool wide) {
  const int64_t span = std::min<int64_t>((chunk + window - 1 + 15) / 16 * 16, std::max<int64_t>(1, n));
  const int64_t rows_most = std::min<int64_t>(chunk, std::max<int64_t>(1, n));
  return {span, rows_most, wide ? rows_most : 0, wide ? span : 0};
}

// Block [i0, i0 + c) of the row whose tokens start at t (N of them): its c queries, its span of nk keys
// from j0 (`span_start`), the windows within it, and its q, k, v operands (bf16 widened into qw, kw, vw)
template <typename Acc>
struct Block {
  int c;
  int64_t j0;
  int nk;
  Windows w;
  const Acc *Q, *K, *V;
};

template <typename Acc, typename T>
inline Block<Acc> block_at(const T* pq, const T* pk, const T* pv, int64_t t, int64_t i0, int64_t N, int64_t chunk,
                           int64_t window, int64_t D, int64_t E, Aligned<Acc>& qw, Aligned<Acc>& kw, Aligned<Acc>& vw) {
  const int c = static_cast<int>(std::min(chunk, N - i0));
  const int64_t j0 = span_start(i0, c, window);
  const int nk = static_cast<int>(i0 + c - j0);
  return {c, j0, nk, Windows{static_cast<int>(i0 - j0), static_cast<int>(window)},
          as_operand<Acc>(pq + (t + i0) * D, qw, c * D), as_operand<Acc>(pk + (t + j0) * D, kw, nk * D),
          as_operand<Acc>(pv + (t + j0) * E, vw, nk * E)};
}

// Hints the next block's n rows (from token i) of q, k, v and x into cache while this block's gemms run:
// the keys and values of a span are new to the cache only in its last n rows
template <typename T, typename X>
inline void prefetch_next(const T* q, const T* k, const T* v, X* x, int64_t i, int64_t n, int64_t D, int64_t E) {
  if (n <= 0) return;
  const int64_t b = int64_t(sizeof(T));
  prefetch_queue().flush();
  prefetch_soon(q + i * D, n * D * b);
  prefetch_soon(k + i * D, n * D * b);
  prefetch_soon(v + i * E, n * E * b);
  prefetch_soon(x + i * E, n * E * b, !std::is_const<X>::value);
}

// The accumulation type of T: float for bf16, else T
template <typename T>
using acc_t = typename std::conditional<std::is_same<T, at::BFloat16>::value, float, T>::type;

// lse's dtype for inputs of type dt: float for bf16, else dt
at::ScalarType lse_dtype(at::ScalarType dt) { return dt == at::kBFloat16 ? at::kFloat : dt; }

template <typename T>
void forward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o,
                  at::Tensor& lse_all, int64_t window, double scale_in, int64_t chunk) {
  using Acc = acc_t<T>;
  constexpr bool wide = !std::is_same<T, Acc>::value;  // bf16: blocks widened to float as they are read
  const int64_t D = q.size(3), E = v.size(3);
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>();
  T* po = o.data_ptr<T>();
  Acc* plse = lse_all.data_ptr<Acc>();
  const Acc scale = static_cast<Acc>(scale_in);
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0_, int64_t i1_) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    const auto [span, rows_most, cw, sw] = block_sizes(chunk, window, q.size(2), wide);
    Aligned<Acc> S(rows_most * span), m(rows_most), l(rows_most), qw(cw * D), kw(sw * D), vw(sw * E), ow(cw * E);
    for (int64_t task = i0_; task < i1_; ++task) {
      const int64_t r = rows.row(task), N = rows.length(r), t = rows.start(r);
      for (int64_t i0 = 0; i0 < N; i0 += chunk) {
        const auto [c, j0, nk, w, Q, K, V] = block_at<Acc>(pq, pk, pv, t, i0, N, chunk, window, D, E, qw, kw, vw);
        T* out = po + (t + i0) * E;
        Acc* O = wide ? ow.data() : reinterpret_cast<Acc*>(out);
        prefetch_next(pq, pk, pv, po, t + i0 + c, std::min<int64_t>(chunk, N - i0 - c), D, E);
        gemm_rm<Acc>(false, true, c, nk, d, Q, d, K, d, Acc(0), S.data(), nk);
        softmax_rows(S.data(), c, nk, w, scale, m.data(), l.data());
        gemm_rm<Acc>(false, false, c, e, nk, S.data(), nk, V, e, Acc(0), O, e);
        finish_rows(O, m.data(), l.data(), c, E, out, plse + t + i0);
      }
    }
  });
}

// The float gradients of dK or dV for bf16 inputs over a sliding range of key rows [base, base + filled)
// of one row of the problem: `cover` makes it hold [j0, j0 + nk) (rows before j0 are final: rounded out
// to bf16 and dropped, the rest moved to the front, new rows zeroed); `flush` writes out what is left.
struct SlidingGrads {
  float* acc;
  int64_t width, base = 0, filled = 0;
  at::BFloat16* out;  // the row's gradient, row 0 = key 0 of the row
  void start(at::BFloat16* row_out) { out = row_out, base = 0, filled = 0; }
  float* cover(int64_t j0, int64_t nk) {
    const int64_t drop = std::min(j0 - base, filled);
    narrow_bf16(acc, out + base * width, drop * width);
    std::memmove(acc, acc + drop * width, (filled - drop) * width * sizeof(float));
    filled -= drop;
    std::fill(acc + filled * width, acc + nk * width, 0.0f);
    base = j0, filled = nk;
    return acc;
  }
  void flush() { narrow_bf16(acc, out + base * width, filled * width); }
};

template <typename T>
void backward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& o, const at::Tensor& lse_all, const at::Tensor& dout, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv, int64_t window, double scale_in, int64_t chunk) {
  using Acc = acc_t<T>;
  constexpr bool wide = !std::is_same<T, Acc>::value;  // bf16: widened blocks, float dK, dV over a sliding range
  const int64_t D = q.size(3), E = v.size(3);
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>(), *po = o.data_ptr<T>();
  const T* pdo = dout.data_ptr<T>();
  const Acc* plse = lse_all.data_ptr<Acc>();
  T *pdq = dq.data_ptr<T>(), *pdk = dk.data_ptr<T>(), *pdv = dv.data_ptr<T>();
  const Acc scale = static_cast<Acc>(scale_in);
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0_, int64_t i1_) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    const auto [span, rows_most, cw, sw] = block_sizes(chunk, window, q.size(2), wide);
    Aligned<Acc> P(rows_most * span), dP(rows_most * span), Dsum(rows_most), qw(cw * D), kw(sw * D), vw(sw * E),
        dow(cw * E), dqw(cw * D), dka(sw * D), dva(sw * E);
    SlidingGrads gk{reinterpret_cast<float*>(dka.data()), D}, gv{reinterpret_cast<float*>(dva.data()), E};
    for (int64_t task = i0_; task < i1_; ++task) {
      const int64_t r = rows.row(task), N = rows.length(r), t = rows.start(r);
      if constexpr (wide) {
        gk.start(reinterpret_cast<at::BFloat16*>(pdk + t * D));
        gv.start(reinterpret_cast<at::BFloat16*>(pdv + t * E));
      } else {
        std::fill(pdk + t * D, pdk + (t + N) * D, T(0));
        std::fill(pdv + t * E, pdv + (t + N) * E, T(0));
      }
      for (int64_t i0 = 0; i0 < N; i0 += chunk) {
        const auto [c, j0, nk, w, Q, K, V] = block_at<Acc>(pq, pk, pv, t, i0, N, chunk, window, D, E, qw, kw, vw);
        const Acc* dO = as_operand<Acc>(pdo + (t + i0) * E, dow, c * E);
        Acc *dQ, *dK, *dV;
        if constexpr (wide) {
          dQ = dqw.data(), dK = gk.cover(j0, nk), dV = gv.cover(j0, nk);
        } else {
          dQ = pdq + (t + i0) * D, dK = pdk + (t + j0) * D, dV = pdv + (t + j0) * E;
        }
        prefetch_next(pq, pk, pv, pdo, t + i0 + c, std::min<int64_t>(chunk, N - i0 - c), D, E);
        if constexpr (!wide)
          prefetch_soon(po + (t + i0 + c) * E, std::min<int64_t>(chunk, N - i0 - c) * E * int64_t(sizeof(T)));
        if constexpr (!wide) row_dots(dO, po + (t + i0) * E, c, E, Dsum.data());  // bf16: D from P and dP
        gemm_rm<Acc>(false, true, c, nk, d, Q, d, K, d, Acc(0), P.data(), nk);  // S
        probabilities(P.data(), c, nk, w, scale, plse + t + i0);
        gemm_rm<Acc>(true, false, nk, e, c, P.data(), nk, dO, e, Acc(1), dV, e);  // dV += Pᵀ dO
        gemm_rm<Acc>(false, true, c, nk, e, dO, e, V, e, Acc(0), dP.data(), nk);  // dP = dO Vᵀ
        score_grads(dP.data(), P.data(), wide ? nullptr : Dsum.data(), c, nk, w, scale);
        gemm_rm<Acc>(false, false, c, d, nk, dP.data(), nk, K, d, Acc(0), dQ, d);  // dQ = dS K
        gemm_rm<Acc>(true, false, nk, d, c, dP.data(), nk, Q, d, Acc(1), dK, d);   // dK += dSᵀ Q
        if constexpr (wide) narrow_bf16(dQ, pdq + (t + i0) * D, c * D);
      }
      if constexpr (wide) {
        if (N > 0) gk.flush(), gv.flush();
      }
    }
  });
}

// Returns (o, lse): o shaped like v, lse (B, H, N) in q's dtype (float for bf16).
std::tuple<at::Tensor, at::Tensor> swa_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                               int64_t window, double scale, int64_t chunk,
                                               const c10::optional<at::Tensor>& cu_seqlens) {
  check_inputs("linattn_cpu::swa_forward", q_in, k_in, v_in, window, chunk);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const Rows rows("linattn_cpu::swa_forward", q, cu_seqlens, 1);
  at::Tensor o = empty_result(v.sizes(), v.options());
  at::Tensor lse = at::empty(q.sizes().slice(0, 3), q.options().dtype(lse_dtype(q.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_swa_forward",
                             [&] { forward_rows<scalar_t>(rows, q, k, v, o, lse, window, scale, chunk); });
  return {o, lse};
}

// Returns (dq, dk, dv).
std::tuple<at::Tensor, at::Tensor, at::Tensor> swa_backward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                            const at::Tensor& v_in, const at::Tensor& o_in,
                                                            const at::Tensor& lse_in, const at::Tensor& do_in,
                                                            int64_t window, double scale, int64_t chunk,
                                                            const c10::optional<at::Tensor>& cu_seqlens) {
  const char* op = "linattn_cpu::swa_backward";
  check_inputs(op, q_in, k_in, v_in, window, chunk);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), o = o_in.contiguous();
  const at::Tensor lse = lse_in.contiguous(), dout = do_in.to(v.scalar_type()).contiguous();
  TORCH_CHECK(o.sizes() == v.sizes() && dout.sizes() == v.sizes() && lse.sizes() == q.sizes().slice(0, 3) &&
                  lse.scalar_type() == lse_dtype(q.scalar_type()) && o.scalar_type() == q.scalar_type(),
              op, ": o, do (shaped like v) and lse (B, H, N) do not match q, k, v");
  const Rows rows(op, q, cu_seqlens, 1);
  at::Tensor dq = empty_result(q.sizes(), q.options()), dk = empty_result(k.sizes(), k.options()),
             dv = empty_result(v.sizes(), v.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_swa_backward", [&] {
    backward_rows<scalar_t>(rows, q, k, v, o, lse, dout, dq, dk, dv, window, scale, chunk);
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def(
      "swa_forward(Tensor q, Tensor k, Tensor v, int window, float scale, int chunk, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "swa_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, int window, float scale, int chunk, "
      "Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("swa_forward", swa_forward);
  m.impl("swa_backward", swa_backward);
}
