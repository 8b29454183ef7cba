// Fused CPU operators for decoding (linattn.ops.native): `step`, one recurrent step of linear
// attention, and `rms_norm`.
//
// step: per row r of the flattened (B·H), with φ the identity (phi = 0) or elu + 1 (phi = 1), and
// R the RoPE rotation (rotate-half) given by (c, s), or none:
//
//   q̃_d = φ(q), k̃_d = φ(k), q̃ = R q̃_d, k̃ = R k̃_d
//   kv' = kv + k̃ vᵀ,  z' = z + k̃_d,  o = q̃ᵀ kv' / (q̃_d · z' + ε)   (o = q̃ᵀ kv' without normalize)
//
// kv (B, H, F, E), z (B, H, F), q, k (B, H, 1, F), v (B, H, 1, E) (any leading dims: rows = B·H),
// all one floating dtype, or bf16 q, k, v on a float32 state; c, s (c_rows, …, F) with row r using
// angles (r / heads) mod c_rows. Returns (o shaped like v, in q's dtype, kv', z').
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "common.h"
#include "step_rows.h"

namespace {

// The checks and the rows of one step, kv' and z' written into kv_new, z_new (contiguous, shaped like
// kv and z; kv and z themselves for the in-place step: each entry is read before it is written).
// Returns o shaped like v, in q's dtype.
at::Tensor step_into(const at::Tensor& kv_in, const at::Tensor& z_in, const at::Tensor& q_in, const at::Tensor& k_in,
                     const at::Tensor& v_in, int64_t phi, bool normalize, double eps,
                     const c10::optional<at::Tensor>& cos_in, const c10::optional<at::Tensor>& sin_in, int64_t heads,
                     const at::Tensor& kv_new, const at::Tensor& z_new) {
  TORCH_CHECK(kv_in.dim() >= 2 && z_in.dim() == kv_in.dim() - 1, "linattn_cpu::step expects kv (..., F, E), z (..., F)");
  TORCH_CHECK(phi == 0 || phi == 1, "linattn_cpu::step: phi must be 0 (identity) or 1 (elu + 1)");
  TORCH_CHECK(cos_in.has_value() == sin_in.has_value(), "linattn_cpu::step: give both cos and sin, or neither");
  const int64_t F = kv_in.size(-2), E = kv_in.size(-1), rows = kv_in.numel() / std::max<int64_t>(1, F * E);
  TORCH_CHECK(z_in.numel() == rows * F && q_in.numel() == rows * F && k_in.numel() == rows * F &&
                  v_in.numel() == rows * E && q_in.size(-1) == F && v_in.size(-1) == E,
              "linattn_cpu::step: shapes of kv, z, q, k, v do not agree");
  TORCH_CHECK(z_in.scalar_type() == kv_in.scalar_type(), "linattn_cpu::step: z must have kv's dtype");
  const at::ScalarType io = input_dtype("linattn_cpu::step", kv_in, {&q_in, &k_in, &v_in});
  // bf16 q, k, v on a float32 state are widened (one token: F + F + E values a row); the step is a
  // rank-1 update and a matrix-vector product on the float32 state, with no gemm to run in bf16
  const at::Tensor kv = kv_in.contiguous(), z = z_in.contiguous(), v = v_in.contiguous().to(kv.scalar_type());
  const at::Tensor q = q_in.contiguous().to(kv.scalar_type()), k = k_in.contiguous().to(kv.scalar_type());
  // φ = elu + 1 of q and k, with the exp of the fused forward (so prefill and decoding agree)
  at::Tensor feats;
  if (phi == 1) {
    feats = at::empty({2 * rows, F}, kv.options());
    AT_DISPATCH_FLOATING_TYPES(kv.scalar_type(), "linattn_cpu_step_phi", [&] {
      elu_plus_one(q.data_ptr<scalar_t>(), feats.data_ptr<scalar_t>(), rows * F);
      elu_plus_one(k.data_ptr<scalar_t>(), feats.data_ptr<scalar_t>() + rows * F, rows * F);
    });
  }
  const bool rope = cos_in.has_value();
  at::Tensor c, s;
  if (rope) {
    c = cos_in->to(kv.scalar_type()).contiguous();
    s = sin_in->to(kv.scalar_type()).contiguous();
    TORCH_CHECK(c.size(-1) == F && s.sizes() == c.sizes() && heads > 0,
                "linattn_cpu::step: cos and sin must be (..., F)");
  }
  at::Tensor o = at::empty(v_in.sizes(), kv.options());
  AT_DISPATCH_FLOATING_TYPES(kv.scalar_type(), "linattn_cpu_step", [&] {
    const scalar_t* pkv = kv.data_ptr<scalar_t>();
    const scalar_t* pz = z.data_ptr<scalar_t>();
    const scalar_t* pq = q.data_ptr<scalar_t>();
    const scalar_t* pk = k.data_ptr<scalar_t>();
    const scalar_t* pf = phi == 1 ? feats.data_ptr<scalar_t>() : nullptr;  // φ of the q rows, then of the k rows
    const scalar_t* pv = v.data_ptr<scalar_t>();
    const scalar_t* pc = rope ? c.data_ptr<scalar_t>() : nullptr;
    const scalar_t* ps = rope ? s.data_ptr<scalar_t>() : nullptr;
    const int64_t c_rows = rope ? c.numel() / F : 1;
    scalar_t* pkv2 = kv_new.data_ptr<scalar_t>();
    scalar_t* pz2 = z_new.data_ptr<scalar_t>();
    scalar_t* po = o.data_ptr<scalar_t>();
    const scalar_t eps_t = static_cast<scalar_t>(eps);
    // one row is F·E multiply-adds: only large batches are worth waking other threads for
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, F * E));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      std::vector<scalar_t> rotated(rope ? 2 * F : 0);
      const int64_t half = F / 2;
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* qd = (phi == 1 ? pf : pq) + r * F;  // the denominator features of row r
        const scalar_t* kd = (phi == 1 ? pf + rows * F : pk) + r * F;
        const scalar_t* qr = qd;
        const scalar_t* kr = kd;
        if (rope) {
          const int64_t a = (r / heads) % c_rows;
          const scalar_t* cr = pc + a * F;
          const scalar_t* sr = ps + a * F;
          scalar_t* qrot = rotated.data();
          scalar_t* krot = qrot + F;
          for (int64_t f = 0; f < F; ++f) {
            const int64_t g = f < half ? f + half : (f < 2 * half ? f - half : f);  // odd F: last kept
            qrot[f] = qd[f] * cr[f] + qd[g] * sr[f];
            krot[f] = kd[f] * cr[f] + kd[g] * sr[f];
          }
          qr = qrot;
          kr = krot;
        }
        scalar_t* out = po + r * E;
        decay_update_row<scalar_t>(pkv + r * F * E, pkv2 + r * F * E, qr, kr, pv + r * E, nullptr, false, out, F, E);
        scalar_t den = scalar_t(0);
        for (int64_t f = 0; f < F; ++f) {
          const scalar_t zf = pz[r * F + f] + kd[f];
          pz2[r * F + f] = zf;
          den += qd[f] * zf;
        }
        if (normalize) {
          const scalar_t inv = scalar_t(1) / (den + eps_t);
          for (int64_t e = 0; e < E; ++e) out[e] *= inv;
        }
      }
    });
  });
  return io == kv.scalar_type() ? o : o.to(io);
}

// One step (step_into). Returns (o, kv', z'); kv and z are left as they were.
std::tuple<at::Tensor, at::Tensor, at::Tensor> step(const at::Tensor& kv, const at::Tensor& z, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& v, int64_t phi, bool normalize,
                                                    double eps, const c10::optional<at::Tensor>& cos,
                                                    const c10::optional<at::Tensor>& sin, int64_t heads) {
  const at::Tensor kv_new = at::empty(kv.sizes(), kv.options()), z_new = at::empty(z.sizes(), z.options());
  at::Tensor o = step_into(kv, z, q, k, v, phi, normalize, eps, cos, sin, heads, kv_new, z_new);
  return {o, kv_new, z_new};
}

// The same, kv' and z' written over kv and z (contiguous): no new state per token (decoding). Returns o.
at::Tensor step_(at::Tensor& kv, at::Tensor& z, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 int64_t phi, bool normalize, double eps, const c10::optional<at::Tensor>& cos,
                 const c10::optional<at::Tensor>& sin, int64_t heads) {
  TORCH_CHECK(kv.is_contiguous() && z.is_contiguous(),
              "linattn_cpu::step_: the state must be contiguous (it is updated in place)");
  return step_into(kv, z, q, k, v, phi, normalize, eps, cos, sin, heads, kv, z);
}

// RMSNorm over the last dim: y = x / √(mean(x²) + eps) · w, x (…, d), w (d); sums in double.
template <typename T>
LINATTN_CLONES void rms_norm_rows(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                  int64_t r0, int64_t r1, int64_t d, double eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(xr[i]) * double(xr[i]);
    const T inv = static_cast<T>(1.0 / std::sqrt(ss / double(d) + eps));
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && w_in.dim() == 1 && x_in.size(-1) == w_in.size(0),
              "linattn_cpu::rms_norm expects x (..., d) and weight (d)");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "linattn_cpu::rms_norm: x and weight must share a dtype");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t d = w.size(0), rows = d == 0 ? 0 : x.numel() / d;
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "linattn_cpu_rms_norm", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    const scalar_t* pw = w.data_ptr<scalar_t>();
    scalar_t* py = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, d)),
                     [&](int64_t r0, int64_t r1) { rms_norm_rows<scalar_t>(px, pw, py, r0, r1, d, eps); });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def(
      "step(Tensor kv, Tensor z, Tensor q, Tensor k, Tensor v, int phi, bool normalize, float eps, "
      "Tensor? cos, Tensor? sin, int heads) -> (Tensor, Tensor, Tensor)");
  m.def(
      "step_(Tensor(a!) kv, Tensor(b!) z, Tensor q, Tensor k, Tensor v, int phi, bool normalize, float eps, "
      "Tensor? cos, Tensor? sin, int heads) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("step", step);
  m.impl("step_", step_);
  m.impl("rms_norm", rms_norm);
}
