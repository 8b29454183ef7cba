// Sliding-window softmax attention (linattn.ops.swa) as fused CPU operators: `swa_forward` and
// `swa_backward`, fp32 and fp64, one (batch, head) row per task (with cu_seqlens one (sequence, head)
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
// 2 (forward) + 5 (backward) gemms of C × (C + W − 1) × D, the exponentials C·W each way.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "blas.h"
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

// Forward: row ii of S (c×nk) becomes P = e^{scale·S − m} on its window, 0 elsewhere; m and the row sum l
// returned per row
template <typename Acc>
LINATTN_CLONES void softmax_rows(Acc* __restrict__ S, int c, int nk, Windows w, Acc scale, Acc* __restrict__ m,
                                 Acc* __restrict__ l) {
  for (int ii = 0; ii < c; ++ii) {
    Acc* __restrict__ s = S + int64_t(ii) * nk;
    const int lo = w.lo(ii), hi = w.hi(ii);
    Acc mx = -std::numeric_limits<Acc>::infinity();
    for (int j = lo; j <= hi; ++j) {
      s[j] *= scale;
      mx = std::max(mx, s[j]);
    }
    Acc sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = lo; j <= hi; ++j) {
      s[j] = exp_nonpositive(s[j] - mx);
      sum += s[j];
    }
    std::fill(s, s + lo, Acc(0));
    std::fill(s + hi + 1, s + nk, Acc(0));
    m[ii] = mx;
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

// dP (c×nk) becomes dS = P ⊙ (dP − D_i)·scale on the windows (0 elsewhere: P is 0 there)
template <typename Acc>
LINATTN_CLONES void score_grads(Acc* __restrict__ dP, const Acc* __restrict__ P, const Acc* __restrict__ D, int c,
                                int nk, Windows w, Acc scale) {
  for (int ii = 0; ii < c; ++ii) {
    Acc* __restrict__ d = dP + int64_t(ii) * nk;
    const Acc* __restrict__ p = P + int64_t(ii) * nk;
    const int lo = w.lo(ii), hi = w.hi(ii);
    const Acc di = D[ii];
#pragma omp simd
    for (int j = lo; j <= hi; ++j) d[j] = p[j] * (d[j] - di) * scale;
    std::fill(d, d + lo, Acc(0));
    std::fill(d + hi + 1, d + nk, Acc(0));
  }
}

// The checks of both passes: q, k (B, H, N, D), v (B, H, N, E) of one dtype, fp32 or fp64; W, C ≥ 1
void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                  int64_t chunk) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              op, " expects q, k (B, H, N, D) and v (B, H, N, E)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, op, ": q, k, v must be fp32 or fp64");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": q, k, v must share a dtype");
  TORCH_CHECK(window >= 1 && chunk >= 1, op, ": window and chunk must be positive");
  const int64_t most = std::numeric_limits<int>::max() / 2;
  TORCH_CHECK(q.size(3) <= most && v.size(3) <= most && chunk <= most && window <= most, op,
              ": D, E, chunk and window must fit an int (BLAS)");
  TORCH_CHECK(has_blas(), op, ": no BLAS gemm found in torch");
}

template <typename T>
void forward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o,
                  at::Tensor& lse_all, int64_t window, double scale_in, int64_t chunk) {
  const int64_t D = q.size(3), E = v.size(3);
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>();
  T *po = o.data_ptr<T>(), *plse = lse_all.data_ptr<T>();
  const T scale = static_cast<T>(scale_in);
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0_, int64_t i1_) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    const int64_t span = std::min<int64_t>(chunk + window - 1, std::max<int64_t>(1, q.size(2)));
    Aligned<T> S(chunk * span), m(chunk), l(chunk);
    for (int64_t task = i0_; task < i1_; ++task) {
      const int64_t r = rows.row(task), N = rows.length(r), t = rows.start(r);
      for (int64_t i0 = 0; i0 < N; i0 += chunk) {
        const int c = static_cast<int>(std::min(chunk, N - i0));
        const int64_t j0 = std::max<int64_t>(0, i0 - window + 1);
        const int nk = static_cast<int>(i0 + c - j0);
        const Windows w{static_cast<int>(i0 - j0), static_cast<int>(window)};
        const T* Q = pq + (t + i0) * D;
        T* O = po + (t + i0) * E;
        gemm_rm<T>(false, true, c, nk, d, Q, d, pk + (t + j0) * D, d, T(0), S.data(), nk);
        softmax_rows(S.data(), c, nk, w, scale, m.data(), l.data());
        gemm_rm<T>(false, false, c, e, nk, S.data(), nk, pv + (t + j0) * E, e, T(0), O, e);
        for (int ii = 0; ii < c; ++ii) {
          const T inv = T(1) / l.data()[ii];
          for (int64_t x = 0; x < E; ++x) O[ii * E + x] *= inv;
          plse[t + i0 + ii] = m.data()[ii] + std::log(l.data()[ii]);
        }
      }
    }
  });
}

template <typename T>
void backward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& o, const at::Tensor& lse_all, const at::Tensor& dout, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv, int64_t window, double scale_in, int64_t chunk) {
  const int64_t D = q.size(3), E = v.size(3);
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>(), *po = o.data_ptr<T>();
  const T *plse = lse_all.data_ptr<T>(), *pdo = dout.data_ptr<T>();
  T *pdq = dq.data_ptr<T>(), *pdk = dk.data_ptr<T>(), *pdv = dv.data_ptr<T>();
  const T scale = static_cast<T>(scale_in);
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0_, int64_t i1_) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    const int64_t span = std::min<int64_t>(chunk + window - 1, std::max<int64_t>(1, q.size(2)));
    Aligned<T> P(chunk * span), dP(chunk * span), Dsum(chunk);
    for (int64_t task = i0_; task < i1_; ++task) {
      const int64_t r = rows.row(task), N = rows.length(r), t = rows.start(r);
      std::fill(pdk + t * D, pdk + (t + N) * D, T(0));
      std::fill(pdv + t * E, pdv + (t + N) * E, T(0));
      for (int64_t i0 = 0; i0 < N; i0 += chunk) {
        const int c = static_cast<int>(std::min(chunk, N - i0));
        const int64_t j0 = std::max<int64_t>(0, i0 - window + 1);
        const int nk = static_cast<int>(i0 + c - j0);
        const Windows w{static_cast<int>(i0 - j0), static_cast<int>(window)};
        const T *Q = pq + (t + i0) * D, *K = pk + (t + j0) * D, *V = pv + (t + j0) * E;
        const T *dO = pdo + (t + i0) * E, *O = po + (t + i0) * E;
        for (int ii = 0; ii < c; ++ii) {
          T s = 0;
#pragma omp simd reduction(+ : s)
          for (int64_t x = 0; x < E; ++x) s += dO[ii * E + x] * O[ii * E + x];
          Dsum.data()[ii] = s;
        }
        gemm_rm<T>(false, true, c, nk, d, Q, d, K, d, T(0), P.data(), nk);  // S
        probabilities(P.data(), c, nk, w, scale, plse + t + i0);
        gemm_rm<T>(true, false, nk, e, c, P.data(), nk, dO, e, T(1), pdv + (t + j0) * E, e);  // dV += Pᵀ dO
        gemm_rm<T>(false, true, c, nk, e, dO, e, V, e, T(0), dP.data(), nk);                   // dP = dO Vᵀ
        score_grads(dP.data(), P.data(), Dsum.data(), c, nk, w, scale);
        gemm_rm<T>(false, false, c, d, nk, dP.data(), nk, K, d, T(0), pdq + (t + i0) * D, d);  // dQ = dS K
        gemm_rm<T>(true, false, nk, d, c, dP.data(), nk, Q, d, T(1), pdk + (t + j0) * D, d);   // dK += dSᵀ Q
      }
    }
  });
}

// Returns (o, lse): o shaped like v, lse (B, H, N) in q's dtype.
std::tuple<at::Tensor, at::Tensor> swa_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                               int64_t window, double scale, int64_t chunk,
                                               const c10::optional<at::Tensor>& cu_seqlens) {
  check_inputs("linattn_cpu::swa_forward", q_in, k_in, v_in, window, chunk);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const Rows rows("linattn_cpu::swa_forward", q, cu_seqlens, 1);
  at::Tensor o = empty_result(v.sizes(), v.options());
  at::Tensor lse = at::empty(q.sizes().slice(0, 3), q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "linattn_cpu_swa_forward",
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
                  lse.scalar_type() == q.scalar_type() && o.scalar_type() == q.scalar_type(),
              op, ": o, do (shaped like v) and lse (B, H, N) do not match q, k, v");
  const Rows rows(op, q, cu_seqlens, 1);
  at::Tensor dq = empty_result(q.sizes(), q.options()), dk = empty_result(k.sizes(), k.options()),
             dv = empty_result(v.sizes(), v.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "linattn_cpu_swa_backward", [&] {
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
