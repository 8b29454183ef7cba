// Fused CPU operators for the causal chunked algorithm (design §3; linattn.ops.native): `chunked`,
// the forward, one (batch, head) row per task, chunk by chunk:
//   A = M ⊙ Q̃K̃ᵀ, O = (A V + Q̃ S) / (A 1 + Q̃ z + ε), S += K̃ᵀV, z += K̃ᵀ1,
// with the state and the C×C scores kept in cache and the products done by the BLAS gemm that torch
// links (looked up at run time; without it the op raises and linattn uses torch ops). For training
// it also saves the denominators and the state entering each block; `chunked_backward` walks the
// rows back from them. With cu_seqlens (packed sequences, rows.h) each (sequence, head) is a row of
// its own, from its own initial state: one call for the whole packed row.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "chunked.h"
#include "pool.h"
#include "rows.h"

namespace {

using linattn_pool::empty_result;
using linattn_pool::release_pool;

// Causal mask and denominators of one chunk: A (c×c, row-major) loses its part above the diagonal;
// den_i = Σ_{j≤i} A_ij + Q̃_i · z + ε
template <typename T, typename Acc>
LINATTN_CLONES void mask_and_denominators(Acc* __restrict__ A, int c, const T* __restrict__ Q, const Acc* __restrict__ z,
                                          int64_t F, Acc eps, Acc* __restrict__ den) {
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ Ai = A + int64_t(i) * c;
    const T* __restrict__ Qi = Q + i * F;
    Acc d = 0, qz = 0;
#pragma omp simd reduction(+ : d)
    for (int j = 0; j <= i; ++j) d += Ai[j];
    for (int j = i + 1; j < c; ++j) Ai[j] = Acc(0);
#pragma omp simd reduction(+ : qz)
    for (int64_t x = 0; x < F; ++x) qz += static_cast<Acc>(Qi[x]) * z[x];
    den[i] = d + qz + eps;
  }
}

// The forward for one dtype T of q, k, v, o; scores, state, normalizer and accumulation in Acc (T,
// or float for bf16), gemm operands in M (T, or float for bf16 on the fp32 path). With bf16 operands
// the scores and the state are rounded to bf16 as gemm operands; on the fp32 path a block's features
// and a chunk's values are widened in cache and only the outputs are rounded. With a training
// forward (saves != nullptr) it also keeps what the backward needs (Saves).
template <typename T, typename M>
void chunked_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o,
                  at::Tensor& kv, at::Tensor& z_all, int64_t phi, bool normalize, double eps, int64_t chunk,
                  int64_t block, const Saves<linattn_acc<T>>* saves) {
  using Acc = linattn_acc<T>;
  constexpr bool low_out = !std::is_same<T, Acc>::value, low_op = !std::is_same<M, Acc>::value;
  constexpr bool widen = !std::is_same<T, M>::value;
  const int64_t F = q.size(3), E = v.size(3);
  const T* pq = q.data_ptr<T>();
  const T* pk = k.data_ptr<T>();
  const T* pv = v.data_ptr<T>();
  T* po = o.data_ptr<T>();
  Acc* pS = kv.data_ptr<Acc>();
  Acc* pz = z_all.data_ptr<Acc>();
  const Acc eps_t = static_cast<Acc>(eps);
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    Aligned<Acc> A(chunk * chunk), den(chunk), U(low_out ? chunk * E : 0);
    Aligned<M> A_low(low_op ? chunk * chunk : 0), S_low(low_op ? F * E : 0), Vw(widen ? chunk * E : 0);
    BlockFeatures<T, M> fb(phi, chunk, F);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = rows.row(i), N = rows.length(r), t_row = rows.start(r);
      Acc* S = pS + r * F * E;
      Acc* z = pz + r * F;
      for (int64_t s = 0; s < N; s += block) {
        const int64_t m = std::min(N, s + block) - s;
        if (saves != nullptr) {
          const int64_t b = rows.first_block(r) + s / block;
          std::copy(S, S + F * E, saves->S_blocks + b * F * E);
          std::copy(z, z + F, saves->z_blocks + b * F);
        }
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
          const int c = static_cast<int>(std::min(chunk, m - c0)), f = static_cast<int>(F), e = static_cast<int>(E);
          // the chunk's features, from rows hinted while the chunk before ran
          fb.compute(pq + (t_row + s + c0) * F, pk + (t_row + s + c0) * F, int64_t(c) * F, phi);
          const M* Qc = fb.Q;
          const M* Kc = fb.K;
          const M* Vc = as_operand<M>(pv + (t_row + s + c0) * E, Vw, int64_t(c) * E);
          T* Oc = po + (t_row + s + c0) * E;
          prefetch_ahead(pq, pk, pv, po, t_row, s + c0, std::min(N, s + c0 + chunk), N, F, E);
          gemm_rm<M>(false, true, c, c, f, Qc, f, Kc, f, Acc(0), A.data(), c);  // A = Q̃K̃ᵀ
          if (normalize) {
            mask_and_denominators(A.data(), c, fb.Qa, z, F, eps_t, den.data());
            if (saves != nullptr) std::copy(den.begin(), den.begin() + c, saves->den + t_row + s + c0);
          } else {
            mask_upper(A.data(), c);
          }
          Acc* U_out = low_out ? U.data() : reinterpret_cast<Acc*>(Oc);
          gemm_rm<M>(false, false, c, e, c, as_operand<M>(A.data(), A_low, int64_t(c) * c), c, Vc, e, Acc(0), U_out,
                     e);                                                                              // A V
          gemm_rm<M>(false, false, c, e, f, Qc, f, as_operand<M>(S, S_low, F * E), e, Acc(1), U_out, e);  // + Q̃ S
          if constexpr (low_out) {
            if (normalize) {
              divide_rows_to_bf16(U_out, den.data(), Oc, c, E);
            } else {
              narrow_bf16(U_out, Oc, int64_t(c) * E);
            }
          } else if (normalize) {
            divide_rows(U_out, den.data(), c, E);
          }
          gemm_rm<M>(true, false, f, e, c, Kc, f, Vc, e, Acc(1), S, e);  // S += K̃ᵀV
          add_column_sums(z, fb.Ka, c, F);
        }
      }
    }
  });
}

// Returns (o, kv, z, den, S_blocks, z_blocks); the last three are empty unless save (training).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunked(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& kv0_in,
    const at::Tensor& z0_in, int64_t phi, bool normalize, double eps, int64_t chunk, bool save, bool wide,
    const c10::optional<at::Tensor>& cu_seqlens) {
  chunk = check_inputs("linattn_cpu::chunked", q_in, k_in, v_in, kv0_in, z0_in, phi, chunk, wide);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), block = block_tokens(chunk);
  const Rows rows("linattn_cpu::chunked", q, cu_seqlens, block);
  TORCH_CHECK(kv0_in.numel() == rows.count() * F * E && z0_in.numel() == rows.count() * F,
              "linattn_cpu::chunked: the initial state must be (B, H, F, E), (B, H, F) (S for B with cu_seqlens)");
  at::Tensor kv = kv0_in.contiguous().clone(), z = z0_in.contiguous().clone();
  at::Tensor o = empty_result(v.sizes(), v.options());
  const auto acc = kv.options();
  at::Tensor den = at::empty({save && normalize ? q.size(0) * q.size(1) : 0, N}, acc);
  at::Tensor S_blocks = at::empty({save ? rows.blocks() : 0, F, E}, acc), z_blocks = at::empty({save ? rows.blocks() : 0, F}, acc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_chunked", [&] {
    using Acc = linattn_acc<scalar_t>;
    const Saves<Acc> saves{normalize ? den.data_ptr<Acc>() : nullptr, S_blocks.data_ptr<Acc>(), z_blocks.data_ptr<Acc>(),
                           rows.blocks()};
    with_operands<scalar_t>(wide, [&](auto op) {
      chunked_rows<scalar_t, decltype(op)>(rows, q, k, v, o, kv, z, phi, normalize, eps, chunk, block,
                                           save ? &saves : nullptr);
    });
  });
  return {o, kv, z, den, S_blocks, z_blocks};
}

// The backward of the causal chunked forward (design §3, the formulas of linattn/ops/chunked.py),
// one (batch, head) row per task, blocks and chunks in reverse. Per block: its features again, and
// the states entering each chunk from the saved state entering the block; per chunk, with R, r the
// gradients flowing into S, z from later tokens (initially ∂L/∂kv, ∂L/∂z of the final state):
//   A = M ⊙ Q̃K̃ᵀ, G = dO / den, g = -Σ_e dO ⊙ O / den, P = M ⊙ (G Vᵀ + g 1ᵀ),
//   dV = Aᵀ G + K̃ R,  dQ̃ = P K̃ + G Sᵀ + g zᵀ,  dK̃ = Pᵀ Q̃ + V Rᵀ + 1 rᵀ,  R += Q̃ᵀ G, r += Q̃ᵀ g,
// then dq = dQ̃ ⊙ φ'(q), dk likewise; the final R, r are the gradients of the initial state.
// Without normalization G = dO and the g terms vanish.
template <typename T, typename M>
void chunked_backward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                           const at::Tensor& dout, const at::Tensor& den_all, const at::Tensor& S_blocks,
                           const at::Tensor& z_blocks, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& R_all,
                           at::Tensor& r_all, int64_t phi, bool normalize, int64_t chunk, int64_t block) {
  using Acc = linattn_acc<T>;
  constexpr bool low_out = !std::is_same<T, Acc>::value, low_op = !std::is_same<M, Acc>::value;
  constexpr bool widen = !std::is_same<T, M>::value;
  const int64_t F = q.size(3), E = v.size(3), per_block = block / chunk;
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>(), *po = o.data_ptr<T>();
  const T* pdo = dout.data_ptr<T>();
  const Acc* pden = normalize ? den_all.data_ptr<Acc>() : nullptr;
  const Acc *pSb = S_blocks.data_ptr<Acc>(), *pzb = z_blocks.data_ptr<Acc>();
  T *pdq = dq.data_ptr<T>(), *pdk = dk.data_ptr<T>(), *pdv = dv.data_ptr<T>();
  Acc *pR = R_all.data_ptr<Acc>(), *pr = r_all.data_ptr<Acc>();
  const int f = static_cast<int>(F), e = static_cast<int>(E);
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    const int64_t cc = chunk * chunk;
    Aligned<Acc> A(cc), P(cc), G(chunk * E), g(chunk), dQ(chunk * F), dK(chunk * F), dV(chunk * E);
    Aligned<Acc> Sc(per_block * F * E), zc(per_block * F);
    Aligned<M> A_low(low_op ? cc : 0), P_low(low_op ? cc : 0), G_low(low_op ? chunk * E : 0), S_low(low_op ? F * E : 0),
        R_low(low_op ? F * E : 0), Vw(widen ? chunk * E : 0);
    BlockFeatures<T, M> fb(phi, block, F);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = rows.row(i), N = rows.length(r), t_row = rows.start(r);
      const int64_t blocks = (N + block - 1) / block;
      Acc* R = pR + r * F * E;
      Acc* rr = pr + r * F;
      for (int64_t b = blocks - 1; b >= 0; --b) {
        const int64_t s = b * block, m = std::min(N, s + block) - s, nch = (m + chunk - 1) / chunk;
        const int64_t saved = rows.first_block(r) + b;
        fb.compute(pq + (t_row + s) * F, pk + (t_row + s) * F, m * F, phi);
        const M *Q = fb.Q, *K = fb.K;
        std::copy(pSb + saved * F * E, pSb + (saved + 1) * F * E, Sc.begin());
        std::copy(pzb + saved * F, pzb + (saved + 1) * F, zc.begin());
        for (int64_t j = 0; j + 1 < nch; ++j) {  // the states entering the block's later chunks
          const int c = static_cast<int>(std::min(chunk, m - j * chunk));
          std::copy(Sc.begin() + j * F * E, Sc.begin() + (j + 1) * F * E, Sc.begin() + (j + 1) * F * E);
          std::copy(zc.begin() + j * F, zc.begin() + (j + 1) * F, zc.begin() + (j + 1) * F);
          const M* Vj = as_operand<M>(pv + (t_row + s + j * chunk) * E, Vw, int64_t(c) * E);
          gemm_rm<M>(true, false, f, e, c, K + j * chunk * F, f, Vj, e, Acc(1), Sc.data() + (j + 1) * F * E, e);
          add_column_sums(zc.data() + (j + 1) * F, fb.Ka + j * chunk * F, c, F);
        }
        for (int64_t j = nch - 1; j >= 0; --j) {
          const int64_t c0 = j * chunk, t0 = t_row + s + c0;
          const int c = static_cast<int>(std::min(chunk, m - c0));
          const M *Qc = Q + c0 * F, *Kc = K + c0 * F, *Vc = as_operand<M>(pv + t0 * E, Vw, int64_t(c) * E);
          const Acc *S = Sc.data() + j * F * E, *z = zc.data() + j * F;
          gemm_rm<M>(false, true, c, c, f, Qc, f, Kc, f, Acc(0), A.data(), c);  // A = Q̃K̃ᵀ
          mask_upper(A.data(), c);
          output_grads(pdo + t0 * E, po + t0 * E, normalize ? pden + t0 : nullptr, normalize, G.data(), g.data(), c, E);
          const M* G_op = as_operand<M>(G.data(), G_low, int64_t(c) * E);
          const M* R_op = as_operand<M>(R, R_low, F * E);
          // dV = Aᵀ G + K̃ R
          Acc* dV_out = low_out ? dV.data() : reinterpret_cast<Acc*>(pdv + t0 * E);
          gemm_rm<M>(true, false, c, e, c, as_operand<M>(A.data(), A_low, int64_t(c) * c), c, G_op, e, Acc(0), dV_out, e);
          gemm_rm<M>(false, false, c, e, f, Kc, f, R_op, e, Acc(1), dV_out, e);
          if constexpr (low_out) chain_features<T, Acc>(dV.data(), nullptr, pdv + t0 * E, int64_t(c) * E);
          // P = M ⊙ (G Vᵀ + g 1ᵀ)
          gemm_rm<M>(false, true, c, c, e, G_op, e, Vc, e, Acc(0), P.data(), c);
          if (normalize) {
            add_rows_and_mask(P.data(), g.data(), c);
          } else {
            mask_upper(P.data(), c);
          }
          const M* P_op = as_operand<M>(P.data(), P_low, int64_t(c) * c);
          // dQ̃ = P K̃ + G Sᵀ + g zᵀ
          gemm_rm<M>(false, false, c, f, c, P_op, c, Kc, f, Acc(0), dQ.data(), f);
          gemm_rm<M>(false, true, c, f, e, G_op, e, as_operand<M>(S, S_low, F * E), e, Acc(1), dQ.data(), f);
          if (normalize) add_outer(dQ.data(), g.data(), z, c, F);
          // dK̃ = Pᵀ Q̃ + V Rᵀ + 1 rᵀ
          gemm_rm<M>(true, false, c, f, c, P_op, c, Qc, f, Acc(0), dK.data(), f);
          gemm_rm<M>(false, true, c, f, e, Vc, e, R_op, e, Acc(1), dK.data(), f);
          add_outer<Acc>(dK.data(), nullptr, rr, c, F);
          // R += Q̃ᵀ G, r += Q̃ᵀ g
          gemm_rm<M>(true, false, f, e, c, Qc, f, G_op, e, Acc(1), R, e);
          if (normalize) add_weighted_rows(rr, g.data(), fb.Qa + c0 * F, c, F);
          chain_features(dQ.data(), fb.fQ == nullptr ? nullptr : fb.fQ + c0 * F, pdq + t0 * F, int64_t(c) * F);
          chain_features(dK.data(), fb.fK == nullptr ? nullptr : fb.fK + c0 * F, pdk + t0 * F, int64_t(c) * F);
        }
      }
    }
  });
}

// Returns (dq, dk, dv, dkv0, dz0). dkv, dz: gradients of the final state (undefined: zero).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunked_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& o_in,
    const at::Tensor& do_in, const at::Tensor& den, const at::Tensor& S_blocks, const at::Tensor& z_blocks,
    const c10::optional<at::Tensor>& dkv, const c10::optional<at::Tensor>& dz, int64_t phi, bool normalize,
    int64_t chunk, bool wide, const c10::optional<at::Tensor>& cu_seqlens) {
  chunk = check_inputs("linattn_cpu::chunked_backward", q_in, k_in, v_in, S_blocks, z_blocks, phi, chunk, wide);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), o = o_in.contiguous(),
                   dout = do_in.to(v.scalar_type()).contiguous();
  TORCH_CHECK(o.sizes() == v.sizes() && dout.sizes() == v.sizes(), "linattn_cpu::chunked_backward: o and do must be shaped like v");
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), block = block_tokens(chunk);
  const Rows rows("linattn_cpu::chunked_backward", q, cu_seqlens, block);
  const int64_t nr = rows.count();
  TORCH_CHECK(S_blocks.numel() == rows.blocks() * F * E && z_blocks.numel() == rows.blocks() * F &&
                  (!normalize || den.numel() == q.size(0) * q.size(1) * N),
              "linattn_cpu::chunked_backward: the saved tensors do not match q, k, v");
  const auto acc = S_blocks.options();
  at::Tensor R = dkv.has_value() ? dkv->to(acc).contiguous().clone() : at::zeros({nr, F, E}, acc);
  at::Tensor r = dz.has_value() ? dz->to(acc).contiguous().clone() : at::zeros({nr, F}, acc);
  TORCH_CHECK(R.numel() == nr * F * E && r.numel() == nr * F, "linattn_cpu::chunked_backward: dkv, dz must be shaped like the state");
  at::Tensor dq = empty_result(q.sizes(), q.options()), dk = empty_result(k.sizes(), k.options()),
             dv = empty_result(v.sizes(), v.options());
  const at::Tensor den_c = den.contiguous(), Sb = S_blocks.contiguous(), zb = z_blocks.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_chunked_backward", [&] {
    with_operands<scalar_t>(wide, [&](auto op) {
      chunked_backward_rows<scalar_t, decltype(op)>(rows, q, k, v, o, dout, den_c, Sb, zb, dq, dk, dv, R, r, phi,
                                                    normalize, chunk, block);
    });
  });
  const int64_t n = rows.sequences(), h = q.size(1);
  return {dq, dk, dv, R.view({n, h, F, E}), r.view({n, h, F})};
}

// linattn_cpu::gemm: c[i] = alpha·op(a[i]) op(b[i]) + beta·c[i] for each i of the batch, by the kernels'
// own row-major product (gemm_rm: the register tiles where they run, else the BLAS), in place on c; with
// beta = 0, c is not read. a: (batch, M, K), or (batch, K, M) with ta; b: (batch, K, N), or (batch, N, K)
// with tb; c: (batch, M, N); float32 or float64, or bf16 a, b with a float32 c (gemm_bf16.h's tiles where
// the CPU has AVX512-BF16, else MKL's bf16 gemm); contiguous. For tests and the roofline's matmul peak.
void gemm_op(const at::Tensor& a, const at::Tensor& b, at::Tensor c, bool ta, bool tb, double alpha, double beta) {
  const char* op = "linattn_cpu::gemm";
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && c.dim() == 3, op, ": a, b and c must be 3-D (batch, rows, columns)");
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (bf16 ? c.scalar_type() == at::kFloat
                        : a.scalar_type() == c.scalar_type() &&
                              (a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble)),
              op, ": a, b and c must all be float32 or all float64, or a and b bfloat16 with c float32");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous(), op, ": a, b and c must be contiguous");
  const int64_t batch = a.size(0), M = ta ? a.size(2) : a.size(1), K = ta ? a.size(1) : a.size(2);
  const int64_t N = tb ? b.size(1) : b.size(2);
  TORCH_CHECK(b.size(0) == batch && (tb ? b.size(2) : b.size(1)) == K, op, ": b's shape ", b.sizes(),
              " does not match a's ", a.sizes());
  TORCH_CHECK(c.size(0) == batch && c.size(1) == M && c.size(2) == N, op, ": c must have shape (", batch, ", ", M,
              ", ", N, "), got ", c.sizes());
  TORCH_CHECK(has_blas() && (!bf16 || has_blas_bf16() || bf16_tiles_enabled()), op, ": no BLAS gemm found in torch");
  // with fewer products than threads, each product's columns are split in blocks of a multiple of 32
  const int64_t threads = at::get_num_threads();
  const int64_t width = batch >= threads ? std::max<int64_t>(N, 1)
                                         : std::max<int64_t>(64, (N + 2 * threads - 1) / (2 * threads) + 31) / 32 * 32;
  const int64_t blocks = (N + width - 1) / width;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, a.scalar_type(), "linattn_cpu_gemm", [&] {
    using Acc = linattn_acc<scalar_t>;
    const scalar_t* A = a.data_ptr<scalar_t>();
    const scalar_t* B = b.data_ptr<scalar_t>();
    Acc* C = c.data_ptr<Acc>();
    at::parallel_for(0, batch * blocks, 1, [&](int64_t t0, int64_t t1) {
      const SequentialBlas one_thread;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = t / blocks, n0 = t % blocks * width, nb = std::min(width, N - n0);
        gemm_rm<scalar_t>(ta, tb, static_cast<int>(M), static_cast<int>(nb), static_cast<int>(K), A + i * M * K,
                          static_cast<int>(ta ? M : K), B + i * K * N + (tb ? n0 * K : n0), static_cast<int>(tb ? K : N),
                          Acc(beta), C + i * M * N + n0, static_cast<int>(N), Acc(alpha));
      }
    });
  });
}

bool uses_bf16_tiles() { return bf16_tiles_enabled(); }

bool uses_tile_gemm() {
#if LINATTN_TILE_GEMM
  return tile_gemm_enabled();
#else
  return false;
#endif
}

// The FLOPs the kernels' products and solves have executed since the extension loaded (flop_count.h)
int64_t executed_flops() { return linattn_count::executed_flops().load(std::memory_order_relaxed); }

}  // namespace

TORCH_LIBRARY(linattn_cpu, m) {
  m.def("has_blas() -> bool", has_blas);
  m.def("has_blas_bf16() -> bool", has_blas_bf16);
  m.def("release_pool() -> int", release_pool);
  m.def("uses_tile_gemm() -> bool", uses_tile_gemm);
  m.def("executed_flops() -> int", executed_flops);
  m.def("uses_bf16_tiles() -> bool", uses_bf16_tiles);
  m.def("gemm(Tensor a, Tensor b, Tensor(c!) c, bool ta, bool tb, float alpha, float beta) -> ()");
  m.def(
      "chunked(Tensor q, Tensor k, Tensor v, Tensor kv0, Tensor z0, int phi, bool normalize, float eps, int chunk, "
      "bool save, bool wide=False, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "chunked_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor do, Tensor den, Tensor S_blocks, "
      "Tensor z_blocks, Tensor? dkv, Tensor? dz, int phi, bool normalize, int chunk, bool wide=False, "
      "Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("gemm", gemm_op);
  m.impl("chunked", chunked);
  m.impl("chunked_backward", chunked_backward);
}
