// Fused CPU operators of gated causal linear attention (the maths in gated.h): `gated_chunked`, the
// chunked forward (for training it also saves the denominators and the state entering each block),
// and `gated_step`, one recurrent step (it checks g ≤ 0 and finite itself). The chunked forward takes
// packed sequences (cu_seqlens: one row per sequence and head, from its own initial state; rows.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <tuple>

#include "gated.h"
#include "pool.h"
#include "rows.h"
#include "step_rows.h"

namespace {

using linattn_pool::empty_result;

// The forward of the rows for inputs of type T and gemm operands of type M (T, or float for bf16 on
// the fp32 path: then a chunk's features and values are widened in cache, the chunk runs
// the fp32 code, and its outputs are rounded to bf16 once)
template <typename T, typename M>
void gated_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                at::Tensor& o, at::Tensor& kv, at::Tensor& z_all, int64_t phi, bool normalize, double eps, int64_t chunk,
                int64_t block, const Saves<linattn_acc<T>>* saves) {
  using Acc = linattn_acc<T>;
  constexpr bool widen = !std::is_same<T, M>::value;
  const int64_t F = q.size(3), E = v.size(3);
  const bool vector = g.dim() == 4;
  const int64_t G = vector ? F : 1;
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>();
  const Acc* pg = g.data_ptr<Acc>();
  T* po = o.data_ptr<T>();
  Acc* pS = kv.data_ptr<Acc>();
  Acc* pz = normalize ? z_all.data_ptr<Acc>() : nullptr;
  const Acc eps_t = static_cast<Acc>(eps);
  std::atomic<bool> all_valid{true};
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    bool valid = true;
    Work<M> wk(chunk, F, E, vector);
    BlockFeatures<T, M> fb(phi, chunk, F);
    Aligned<M> Vw(widen ? chunk * E : 0), Ow(widen ? chunk * E : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = rows.row(i), N = rows.length(r), t_row = rows.start(r);
      Acc* S = pS + r * F * E;
      Acc* z = normalize ? pz + r * F : nullptr;
      for (int64_t s = 0; s < N; s += block) {
        const int64_t m = std::min(N, s + block) - s;
        if (saves != nullptr) {
          const int64_t b = rows.first_block(r) + s / block;
          std::copy(S, S + F * E, saves->S_blocks + b * F * E);
          if (normalize) std::copy(z, z + F, saves->z_blocks + b * F);
        }
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
          const int c = static_cast<int>(std::min(chunk, m - c0));
          const int64_t t0 = t_row + s + c0;
          Acc* den_out = saves != nullptr && normalize ? saves->den + t0 : nullptr;
          // the chunk's features, from rows hinted while the chunk before ran
          fb.compute(pq + t0 * F, pk + t0 * F, int64_t(c) * F, phi);
          prefetch_ahead(pq, pk, pv, po, t_row, s + c0, std::min(N, s + c0 + chunk), N, F, E);
          if (s + c0 + c < N)  // the next chunk's gates (per channel: as many bytes as its q)
            prefetch_soon(pg + (t0 + c) * G, std::min<int64_t>(chunk, N - s - c0 - c) * G * int64_t(sizeof(Acc)));
          const M* V = as_operand<M>(pv + t0 * E, Vw, int64_t(c) * E);
          M* O;
          if constexpr (widen) {
            O = Ow.data();
          } else {
            O = po + t0 * E;
          }
          if (vector) {
            vector_chunk_forward<M>(wk, c, F, E, fb.Qa, fb.Ka, V, pg + t0 * G, S, z, O, normalize, eps_t, den_out,
                                    valid);
          } else {
            valid = valid && gates_valid(pg + t0, c);
            scalar_chunk_forward<M>(wk, c, F, E, fb.Q, fb.K, fb.Qa, fb.Ka, V, pg + t0, S, z, O, normalize, eps_t);
            if (den_out != nullptr) std::copy(wk.den.begin(), wk.den.begin() + c, den_out);
          }
          if constexpr (widen) narrow_bf16(O, po + t0 * E, int64_t(c) * E);
        }
      }
    }
    if (!valid) all_valid = false;
  });
  if (!all_valid) raise_invalid_gate(g, "g (the log of the decay) must be ≤ 0 and finite, got ");
}

// Returns (o, kv, z, den, S_blocks, z_blocks); z and z_blocks empty without z0 (normalize = z0 given),
// den, S_blocks, z_blocks empty unless save (training).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_chunked(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
    const at::Tensor& kv0_in, const c10::optional<at::Tensor>& z0_in, int64_t phi, double eps, int64_t chunk, bool save,
    bool wide, const c10::optional<at::Tensor>& cu_seqlens) {
  const bool normalize = z0_in.has_value();
  chunk = check_inputs("linattn_cpu::gated_chunked", q_in, k_in, v_in, kv0_in, normalize ? *z0_in : kv0_in, phi, chunk,
                       wide);
  check_gates("linattn_cpu::gated_chunked", q_in, g_in, kv0_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous();
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), block = block_tokens(chunk);
  const Rows rows("linattn_cpu::gated_chunked", q, cu_seqlens, block);
  TORCH_CHECK(kv0_in.numel() == rows.count() * F * E && (!normalize || z0_in->numel() == rows.count() * F),
              "linattn_cpu::gated_chunked: the initial state must be (B, H, F, E) and (B, H, F) (S for B with "
              "cu_seqlens)");
  at::Tensor kv = kv0_in.contiguous().clone();
  at::Tensor z = normalize ? z0_in->contiguous().clone() : at::empty({0}, kv.options());
  at::Tensor o = empty_result(v.sizes(), v.options());
  const int64_t blocks = rows.blocks();
  const auto acc = kv.options();
  at::Tensor den = at::empty({save && normalize ? q.size(0) * q.size(1) : 0, N}, acc);
  at::Tensor S_blocks = at::empty({save ? blocks : 0, F, E}, acc);
  at::Tensor z_blocks = at::empty({save && normalize ? blocks : 0, F}, acc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_gated_chunked", [&] {
    using Acc = linattn_acc<scalar_t>;
    const Saves<Acc> saves{normalize ? den.data_ptr<Acc>() : nullptr, S_blocks.data_ptr<Acc>(),
                           normalize ? z_blocks.data_ptr<Acc>() : nullptr, blocks};
    with_operands<scalar_t>(wide, [&](auto op) {
      gated_rows<scalar_t, decltype(op)>(rows, q, k, v, g, o, kv, z, phi, normalize, eps, chunk, block,
                                         save ? &saves : nullptr);
    });
  });
  return {o, kv, z, den, S_blocks, z_blocks};
}

// kv (…, F, E), z (…, F) or none (normalize = z given), q, k (…, 1, F), v (…, 1, E), g (…, 1) or
// (…, 1, F) of one dtype (float32/float64), or bf16 q, k, v on a float32 state: the checks and the rows
// of one step, kv' and z' written into kv_new, z_new (contiguous; kv and z themselves for the in-place
// step: decay_update_row reads each entry before writing it). Returns o shaped like v, in q's dtype.
at::Tensor gated_step_into(const char* op, const at::Tensor& kv_in, const c10::optional<at::Tensor>& z_in,
                           const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                           int64_t phi, double eps, const at::Tensor* kv_out, const at::Tensor* z_out) {
  const bool normalize = z_in.has_value();
  TORCH_CHECK(kv_in.dim() >= 2, op, " expects kv (..., F, E)");
  TORCH_CHECK(phi == 0 || phi == 1, op, ": phi must be 0 (identity) or 1 (elu + 1)");
  const int64_t F = kv_in.size(-2), E = kv_in.size(-1), rows = kv_in.numel() / std::max<int64_t>(1, F * E);
  const bool vector = g_in.numel() == rows * F && F != 1;
  TORCH_CHECK((!normalize || z_in->numel() == rows * F) && q_in.numel() == rows * F && k_in.numel() == rows * F &&
                  v_in.numel() == rows * E && q_in.size(-1) == F && v_in.size(-1) == E &&
                  (g_in.numel() == rows || g_in.numel() == rows * F),
              op, ": shapes of kv, z, q, k, v, g do not agree");
  TORCH_CHECK(g_in.scalar_type() == kv_in.scalar_type(), op, ": g must have kv's dtype");
  if (normalize) TORCH_CHECK(z_in->scalar_type() == kv_in.scalar_type(), op, ": z must have kv's dtype");
  const at::ScalarType io = input_dtype(op, kv_in, {&q_in, &k_in, &v_in});
  // bf16 q, k, v on a float32 state are widened, as in linattn_cpu::step
  const auto sdt = kv_in.scalar_type();
  const at::Tensor kv = kv_in.contiguous(), q = q_in.contiguous().to(sdt), k = k_in.contiguous().to(sdt),
                   v = v_in.contiguous().to(sdt), g = g_in.contiguous();
  const at::Tensor z = normalize ? z_in->contiguous() : at::Tensor();
  const at::Tensor kv_new = kv_out != nullptr ? *kv_out : at::empty_like(kv);
  const at::Tensor z_new = !normalize ? at::Tensor() : z_out != nullptr ? *z_out : at::empty_like(z);
  at::Tensor o = at::empty(v_in.sizes(), kv.options());
  AT_DISPATCH_FLOATING_TYPES(kv.scalar_type(), "linattn_cpu_gated_step", [&] {
    const int64_t ng = g.numel();
    const scalar_t* pg = g.data_ptr<scalar_t>();
    for (int64_t i = 0; i < ng; ++i) {
      TORCH_CHECK_VALUE(pg[i] <= scalar_t(0) && pg[i] > -std::numeric_limits<scalar_t>::infinity(),
                        "g (the log of the decay) must be ≤ 0 and finite, got ", pg[i]);
    }
    // the decays e^g and, with φ = elu + 1, the features of the q rows then the k rows
    Aligned<scalar_t> work(ng + (phi == 1 ? 2 * rows * F : 0));
    scalar_t* pa = work.data();
    for (int64_t i = 0; i < ng; ++i) pa[i] = exp_nonpositive(pg[i]);
    scalar_t* pf = phi == 1 ? pa + ng : nullptr;
    if (phi == 1) {
      elu_plus_one(q.data_ptr<scalar_t>(), pf, rows * F);
      elu_plus_one(k.data_ptr<scalar_t>(), pf + rows * F, rows * F);
    }
    const scalar_t* pq = phi == 1 ? pf : q.data_ptr<scalar_t>();
    const scalar_t* pk = phi == 1 ? pf + rows * F : k.data_ptr<scalar_t>();
    const scalar_t *pkv = kv.data_ptr<scalar_t>(), *pv = v.data_ptr<scalar_t>();
    const scalar_t* pz = normalize ? z.data_ptr<scalar_t>() : nullptr;
    scalar_t *pkv2 = kv_new.data_ptr<scalar_t>(), *po = o.data_ptr<scalar_t>();
    scalar_t* pz2 = normalize ? z_new.data_ptr<scalar_t>() : nullptr;
    const scalar_t eps_t = static_cast<scalar_t>(eps);
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, F * E));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *qr = pq + r * F, *kr = pk + r * F, *a = pa + r * (vector ? F : 1);
        scalar_t* out = po + r * E;
        decay_update_row<scalar_t>(pkv + r * F * E, pkv2 + r * F * E, qr, kr, pv + r * E, a, vector, out, F, E);
        if (normalize) {
          scalar_t den = 0;
          for (int64_t f = 0; f < F; ++f) {
            const scalar_t zf = a[vector ? f : 0] * pz[r * F + f] + kr[f];
            pz2[r * F + f] = zf;
            den += qr[f] * zf;
          }
          const scalar_t inv = scalar_t(1) / (den + eps_t);
          for (int64_t e = 0; e < E; ++e) out[e] *= inv;
        }
      }
    });
  });
  return io == sdt ? o : o.to(io);
}

// One step (gated_step_into). Returns (o, kv', z' or an empty tensor); kv and z are left as they were.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_step(const at::Tensor& kv, const c10::optional<at::Tensor>& z,
                                                          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& g, int64_t phi, double eps) {
  TORCH_CHECK(kv.dim() >= 2, "linattn_cpu::gated_step expects kv (..., F, E)");
  const at::Tensor kv_new = at::empty(kv.sizes(), kv.options());
  const at::Tensor z_new = z.has_value() ? at::empty(z->sizes(), z->options()) : at::empty({0}, kv.options());
  at::Tensor o = gated_step_into("linattn_cpu::gated_step", kv, z, q, k, v, g, phi, eps, &kv_new,
                                 z.has_value() ? &z_new : nullptr);
  return {o, kv_new, z_new};
}

// The same, kv' and z' written over kv and z (contiguous): no new state per token (decoding). Returns o.
at::Tensor gated_step_(at::Tensor& kv, const c10::optional<at::Tensor>& z, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& g, int64_t phi, double eps) {
  TORCH_CHECK(kv.is_contiguous() && (!z.has_value() || z->is_contiguous()),
              "linattn_cpu::gated_step_: the state must be contiguous (it is updated in place)");
  return gated_step_into("linattn_cpu::gated_step_", kv, z, q, k, v, g, phi, eps, &kv,
                         z.has_value() ? &*z : nullptr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def(
      "gated_chunked(Tensor q, Tensor k, Tensor v, Tensor g, Tensor kv0, Tensor? z0, int phi, float eps, int chunk, "
      "bool save, bool wide=False, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "gated_step(Tensor kv, Tensor? z, Tensor q, Tensor k, Tensor v, Tensor g, int phi, float eps) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "gated_step_(Tensor(a!) kv, Tensor(b!)? z, Tensor q, Tensor k, Tensor v, Tensor g, int phi, float eps) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("gated_chunked", gated_chunked);
  m.impl("gated_step", gated_step);
  m.impl("gated_step_", gated_step_);
}
