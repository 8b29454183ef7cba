// Fused CPU operator for one token of Kimi Delta Attention (design §18; linattn.ops.kda), per
// (batch, head) row:
//
//   S_α = Diag(e^{g}) S,   u = S_αᵀ k̂,   w = β (v − u),   S' = S_α + k̂ wᵀ,   o = scale · S'ᵀ q̂
//
// (= (I − β k̂k̂ᵀ) Diag(α) S + β k̂ vᵀ), q̂, k̂ the L2-normalized q, k (l2norm) or q, k themselves. The
// decay is one factor per key channel, so it scales the D rows of S. Arithmetic in Acc (float for
// fp32 and bf16 inputs, double for fp64); bf16 rows are widened as they are read. β and g come in
// Acc and are checked here. The chunked form runs with torch ops (linattn/ops/kda/chunked.py).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "blas.h"
#include "common.h"
#include "step_rows.h"

namespace {

// D values of src into dst (widened from bf16), L2-normalized with l2norm
template <typename T, typename Acc>
LINATTN_CLONES void load_row(const T* __restrict__ src, Acc* __restrict__ dst, int64_t D, bool l2norm) {
  if constexpr (std::is_same<T, Acc>::value) {
    std::memcpy(dst, src, sizeof(Acc) * D);
  } else {
    widen_bf16(src, dst, D);
  }
  if (!l2norm) return;
  Acc ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) ss += dst[d] * dst[d];
  const Acc r = Acc(1) / std::sqrt(ss + Acc(kL2Eps));
  for (int64_t d = 0; d < D; ++d) dst[d] *= r;
}

// One row: S, S2 (D×E), q̂, k̂ (D), α (D), v (E); u: 2·E of scratch
template <typename T, typename Acc>
LINATTN_CLONES void kda_update_row(const Acc* S, Acc* S2, const Acc* __restrict__ q, const Acc* __restrict__ k,
                                   const Acc* __restrict__ alpha, const T* __restrict__ v, Acc beta, Acc scale,
                                   T* __restrict__ o, Acc* __restrict__ u, int64_t D, int64_t E) {
  for (int64_t e = 0; e < E; ++e) u[e] = Acc(0);
  for (int64_t d = 0; d < D; ++d) {
    const Acc kd = k[d] * alpha[d];
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) u[e] += kd * S[d * E + e];
  }
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) u[e] = beta * (static_cast<Acc>(v[e]) - u[e]);  // w
  Acc* __restrict__ out = u + E;
  for (int64_t e = 0; e < E; ++e) out[e] = Acc(0);
  for (int64_t d = 0; d < D; ++d) {
    const Acc kd = k[d], qd = q[d], ad = alpha[d];
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) {
      const Acc x = ad * S[d * E + e] + kd * u[e];
      S2[d * E + e] = x;
      out[e] += qd * x;
    }
  }
  for (int64_t e = 0; e < E; ++e) o[e] = static_cast<T>(scale * out[e]);
}

// β in [0, 2] and g ≤ 0, finite: raises a ValueError naming the argument, as linattn's checks do
template <typename Acc>
void check_kda_values(const at::Tensor& beta, const at::Tensor& g) {
  const Acc* b = beta.data_ptr<Acc>();
  for (int64_t i = 0; i < beta.numel(); ++i) {
    TORCH_CHECK_VALUE(b[i] >= Acc(0) && b[i] <= Acc(2), "beta must lie in [0, 2] (finite), got ", b[i]);
  }
  const Acc* p = g.data_ptr<Acc>();
  for (int64_t i = 0; i < g.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] <= Acc(0) && std::isfinite(p[i]), "g must be a finite log-decay ≤ 0, got ", p[i]);
  }
}

// S (B, H, D, E) in Acc, q, k (B, H, 1, D), v (B, H, 1, E), β (B, H, 1) and g (B, H, 1, D) in Acc.
// Returns (o shaped like v, S').
std::tuple<at::Tensor, at::Tensor> kda_step(const at::Tensor& S_in, const at::Tensor& q_in, const at::Tensor& k_in,
                                            const at::Tensor& v_in, const at::Tensor& beta_in, const at::Tensor& g_in,
                                            double scale, bool l2norm) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1 && k_in.sizes() == q_in.sizes() && v_in.dim() == 4 &&
                  v_in.sizes().slice(0, 3) == q_in.sizes().slice(0, 3),
              "linattn_cpu::kda_step expects q, k (B, H, 1, D) and v (B, H, 1, E)");
  const int64_t D = q_in.size(3), E = v_in.size(3), rows = q_in.size(0) * q_in.size(1);
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
              "linattn_cpu::kda_step: q, k, v must share a dtype");
  const auto acc = q_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(S_in.scalar_type() == acc && beta_in.scalar_type() == acc && g_in.scalar_type() == acc,
              "linattn_cpu::kda_step: the state, beta and g must be float64 for float64 inputs, else float32");
  TORCH_CHECK(S_in.numel() == rows * D * E && beta_in.numel() == rows && g_in.numel() == rows * D,
              "linattn_cpu::kda_step: shapes of the state, beta and g do not agree with q, v");
  const at::Tensor S = S_in.contiguous(), q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor beta = beta_in.contiguous(), g = g_in.contiguous();
  at::Tensor S2 = at::empty(S_in.sizes(), S.options()), o = at::empty(v_in.sizes(), v.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_kda_step", [&] {
    using Acc = linattn_acc<scalar_t>;
    check_kda_values<Acc>(beta, g);
    const scalar_t *pq = q.data_ptr<scalar_t>(), *pk = k.data_ptr<scalar_t>(), *pv = v.data_ptr<scalar_t>();
    const Acc *pS = S.data_ptr<Acc>(), *pb = beta.data_ptr<Acc>(), *pg = g.data_ptr<Acc>();
    Acc* pS2 = S2.data_ptr<Acc>();
    scalar_t* po = o.data_ptr<scalar_t>();
    // one row is 2·D·E multiply-adds: only large batches are worth waking other threads for
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, D * E));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      const FlushDenormals flush;  // α S with α = e^g tiny
      Aligned<Acc> qka(3 * D), u(2 * E);
      for (int64_t r = r0; r < r1; ++r) {
        load_row(pq + r * D, qka.data(), D, l2norm);
        load_row(pk + r * D, qka.data() + D, D, l2norm);
        Acc* alpha = qka.data() + 2 * D;
        for (int64_t d = 0; d < D; ++d) alpha[d] = std::exp(pg[r * D + d]);
        kda_update_row<scalar_t, Acc>(pS + r * D * E, pS2 + r * D * E, qka.data(), qka.data() + D, alpha, pv + r * E,
                                      pb[r], static_cast<Acc>(scale), po + r * E, u.data(), D, E);
      }
    });
  });
  return {o, S2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def("kda_step(Tensor S, Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, float scale, bool l2norm) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) { m.impl("kda_step", kda_step); }
