// The attention of one layer for one decoded token (model_step.cpp), per (batch row, head), after the
// layer's fused q|k|v projection (and the output gate's, β's and the decays' projections, done by the
// matvec group before it; the decays: model_decay.h): the short convolution over the head's q, k, v
// channels with its cache tail, then the kind's recurrence on its cached state, in place, then the
// per-head output norm and gate, into the buffer the output projection reads.
//
//   linear           φ (elu, relu, favor, trig, cosformer, taylor, hedgehog), RoPE on the features,
//                    kv += k̃ᵣ vᵀ, z += k̃, o = q̃ᵣᵀ kv / (q̃ · z + ε)                        (design §3–6)
//   gated            q·D^{−1/2}, S = diag(e^g) S + k vᵀ, o = Sᵀ q; g RetNet's, Mamba2's or GLA's (§8, §12),
//                    or HGRN2's logsigmoid of the k block with k ← 1 − e^g
//   delta            SiLU, S = α (I − β k̂k̂ᵀ) S + β k̂ vᵀ, o = D^{−1/2} Sᵀ q̂                        (§13)
//                    (KDA: S = (I − β k̂k̂ᵀ) Diag(α) S + β k̂ vᵀ, α per key channel, §13.8)
//   softmax          the new k, v appended to the KV cache, o = softmax(q·K/√D) V                   (§8)
//
// The window family's mixer (swa, LoLCATs, Liger) is in model_window.h, the feature maps of the linear one
// in model_features.h; model_step.cpp's `mixer_table()` names them all. Each computes what linattn's
// eager layers compute, in float, with the bf16 roundings of a bf16 model where the eager path holds bf16
// tensors (model_ops.h). Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model_decay.h"
#include "model_features.h"
#include "model_ops.h"
#include "step_rows.h"

namespace {

// What every kind shares: the head layout, the q|k|v buffer, its convolution, RoPE on q and k, the
// output gate and the output buffer.
class AttentionMixOp : public Op {
 public:
  AttentionMixOp(const Args& a, bool bf16)
      : qkv_(buffer(a, "qkv")), o_(buffer(a, "out")), heads_(a.integer("heads")), dq_(a.integer("qk_dim")),
        dv_(a.integer("v_dim")), R_{bf16} {
    TORCH_CHECK(qkv_.ld == heads_ * (2 * dq_ + dv_) && o_.ld == heads_ * dv_,
                "linattn_cpu::DecodePlan: q|k|v or output buffer of the wrong width");
    if (a.has("conv_weight")) {
      conv_w_ = a.tensor("conv_weight").to(at::kFloat).contiguous();
      conv_wt_ = conv_w_.t().contiguous();
      taps_ = conv_w_.size(1);
      tail_ = Held(a.tensor("tail"));
    }
    rope_c_ = maybe_buffer(a, "rope_cos");
    rope_s_ = maybe_buffer(a, "rope_sin");
    rope_dim_ = a.integer("rope_dim", dq_);  // partial RoPE: the first rope_dim features of q and k
    TORCH_CHECK(rope_dim_ > 0 && rope_dim_ <= dq_, "linattn_cpu::DecodePlan: rope_dim out of range");
    gate_ = maybe_buffer(a, "gate");
    sigmoid_gate_ = a.integer("sigmoid_gate", 0) != 0;
    if (gate_.defined() && !sigmoid_gate_) {
      gate_w_ = a.tensor("gate_norm_weight").to(at::kFloat).contiguous();
      gate_eps_ = static_cast<float>(a.real("gate_norm_eps"));
      norm_sigmoid_ = a.integer("gate_norm_sigmoid", 0) != 0;  // KDA's gate: sigmoid, not swish
    }
    // RMSNorms of q and k: per head (Qwen3's, Qwen3.5's qk_norm), or across the heads (qk_norm_all:
    // one over a row's H·D values of q, one over k's, OLMo's; read from the projection, so without a
    // short convolution)
    qk_norm_all_ = a.integer("qk_norm_all", 0) != 0;
    if (a.has("q_norm_weight")) {
      q_norm_w_ = a.tensor("q_norm_weight").to(at::kFloat).contiguous();
      k_norm_w_ = a.tensor("k_norm_weight").to(at::kFloat).contiguous();
      qk_norm_eps_ = static_cast<float>(a.real("qk_norm_eps"));
      const int64_t n = qk_norm_all_ ? heads_ * dq_ : dq_;
      TORCH_CHECK(q_norm_w_.numel() == n && k_norm_w_.numel() == n && !(qk_norm_all_ && taps_ > 0),
                  "linattn_cpu::DecodePlan: bad qk_norm");
    }
  }

  size_t scratch(const StepInfo& info) const override { return 2 * dq_ + 3 * dv_ + 16 + row_scratch(info); }

  void run(const StepInfo& info, int tid, int threads, float* scratch) override {
    const int64_t rows = info.batch * heads_, r0 = rows * tid / threads, r1 = rows * (tid + 1) / threads;
    float* q = scratch;
    float* k = q + dq_;
    float* v = k + dq_;
    float* o = v + dv_;
    float* tmp = o + 2 * dv_ + 16;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / heads_, h = r % heads_;
      load_head(b, h, q, k, v);
      if (q_norm_w_.defined()) norm_qk(b, h, q, k);
      activate(q, k, v);
      if (!rotates_itself_) rotate_qk(b, q, k, tmp);
      mix(info, b, h, q, k, v, o, tmp);
      float* out = o_.p + b * o_.ld + h * dv_;
      if (gate_.defined() && sigmoid_gate_) {  // o ← o ⊙ sigmoid(W_g x): linattn.nn.base.SigmoidGate
        const float* g = gate_.p + b * gate_.ld + h * dv_;
        for (int64_t e = 0; e < dv_; ++e) out[e] = R_(o[e] * R_(1.0f / (1.0f + std::exp(-g[e]))));
      } else if (gate_.defined()) {  // o ← RMSNorm(o) ⊙ swish(W_g x) (OutputGate), or ⊙ sigmoid(·) (KDA's)
        float* normed = o + dv_;
        normalize(kRMSNorm, o, normed, dv_, gate_w_.data_ptr<float>(), nullptr, gate_eps_, R_);
        const float* g = gate_.p + b * gate_.ld + h * dv_;
        if (norm_sigmoid_) {
          for (int64_t e = 0; e < dv_; ++e) out[e] = R_(normed[e] * R_(sigmoid(g[e])));
        } else {
          for (int64_t e = 0; e < dv_; ++e) out[e] = R_(normed[e] * R_(silu(g[e])));
        }
      } else {
        std::copy(o, o + dv_, out);
      }
    }
  }

 protected:
  virtual size_t row_scratch(const StepInfo&) const = 0;
  // the kind's token: q, k, v of head h of row b (RoPE applied) -> o (E values of the output dtype)
  virtual void mix(const StepInfo& info, int64_t b, int64_t h, float* q, float* k, float* v, float* o,
                   float* tmp) = 0;
  virtual void activate(float*, float*, float*) {}

  // q and k of batch row b rotated by RoPE, in place (nothing without RoPE); tmp: rope_dim floats. run()
  // rotates them before `mix`, unless the mixer reads them unrotated too (rotates_itself_: Liger's gated
  // part, HGRN2's gates), and then calls this itself
  void rotate_qk(int64_t b, float* q, float* k, float* tmp) const {
    if (!rope_c_.defined()) return;
    const float* c = rope_c_.p + b * rope_c_.ld;
    const float* s = rope_s_.p + b * rope_s_.ld;
    rotate(q, c, s, tmp, rope_dim_, R_);
    std::copy(tmp, tmp + rope_dim_, q);
    rotate(k, c, s, tmp, rope_dim_, R_);
    std::copy(tmp, tmp + rope_dim_, k);
  }

  // q, k of head h of row b through their RMSNorms, per head or across the heads (the row's H·D
  // values of the projection, 1/rms recomputed by each head: H·D reads)
  void norm_qk(int64_t b, int64_t h, float* q, float* k) const {
    const float* row = qkv_.p + b * qkv_.ld;
    const at::Tensor* w[2] = {&q_norm_w_, &k_norm_w_};
    float* x[2] = {q, k};
    for (int part = 0; part < 2; ++part) {
      const float* gain = w[part]->data_ptr<float>();
      const float inv = qk_norm_all_ ? rms_inverse(row + part * heads_ * dq_, heads_ * dq_, qk_norm_eps_, R_)
                                     : rms_inverse(x[part], dq_, qk_norm_eps_, R_);
      rms_scale(x[part], x[part], dq_, inv, qk_norm_all_ ? gain + h * dq_ : gain, R_);
    }
  }

  // q, k, v of one head: the projection's channels, through the short convolution when there is one
  void load_head(int64_t b, int64_t h, float* q, float* k, float* v) {
    const float* row = qkv_.p + b * qkv_.ld;
    const int64_t starts[3] = {h * dq_, heads_ * dq_ + h * dq_, 2 * heads_ * dq_ + h * dv_};
    const int64_t sizes[3] = {dq_, dq_, dv_};
    float* dst[3] = {q, k, v};
    if (taps_ > 0 && !tail_.bf16 && !R_.bf16) {
      for (int part = 0; part < 3; ++part) conv_channels(b, starts[part], sizes[part], row, dst[part]);
      return;
    }
    const float* conv_w = taps_ == 0 ? nullptr : conv_w_.data_ptr<float>();
    for (int part = 0; part < 3; ++part) {
      for (int64_t i = 0; i < sizes[part]; ++i) {
        const int64_t c = starts[part] + i;
        dst[part][i] = taps_ == 0 ? row[c]
                                  : MatvecGroupOp::short_conv(tail_, b, c, qkv_.ld, taps_, row[c],
                                                              conv_w + c * taps_, 0.0f, R_, false);
      }
    }
  }

  // fp32 tails and model: the short convolution of channels c0 … c0+n−1 of batch row b (as
  // MatvecGroupOp::short_conv computes each: Σ_m w_cm [tail; x]_m, the same sums in the same order),
  // by tap across the channels, so that the tail rows (out of cache after the weights stream by) are
  // read in order; then the tails move on
  void conv_channels(int64_t b, int64_t c0, int64_t n, const float* row, float* out) {
    const int64_t C = qkv_.ld, T = taps_;
    float* tail = static_cast<float*>(tail_.p) + b * (T - 1) * C + c0;
    const float* x = row + c0;
    const float* w = conv_wt_.data_ptr<float>() + c0;  // (T, C): tap m of channel c at m·C + c
    for (int64_t m = 0; m < T; ++m) {
      const float* xm = m + 1 < T ? tail + m * C : x;
      const float* wm = w + m * C;
      if (m == 0) {
        for (int64_t i = 0; i < n; ++i) out[i] = xm[i] * wm[i];
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = out[i] + xm[i] * wm[i];
      }
    }
    for (int64_t m = 0; m + 2 < T; ++m) std::copy(tail + (m + 1) * C, tail + (m + 1) * C + n, tail + m * C);
    if (T > 1) std::copy(x, x + n, tail + (T - 2) * C);
  }

  Buffer qkv_, o_;
  int64_t heads_, dq_, dv_;
  Rounder R_;
  bool rotates_itself_ = false;

 private:
  at::Tensor conv_w_, conv_wt_;
  Held tail_;
  int64_t taps_ = 0;
  Buffer rope_c_, rope_s_, gate_;
  int64_t rope_dim_;
  bool sigmoid_gate_ = false;
  bool norm_sigmoid_ = false;
  at::Tensor gate_w_, q_norm_w_, k_norm_w_;
  float gate_eps_ = 0, qk_norm_eps_ = 0;
  bool qk_norm_all_ = false;
};

// ----------------------------------------------------------------------------------------------
// linear attention with a feature map (model_features.h)

class LinearMixOp : public AttentionMixOp {
 public:
  LinearMixOp(const Args& a, bool bf16)
      : AttentionMixOp(a, bf16), phi_(a, dq_, bf16), F_(phi_.dim()), normalize_(a.integer("normalize") != 0),
        eps_(static_cast<float>(a.real("eps"))) {
    state_ = a.tensor("kv");
    z_t_ = a.tensor("z");
    kv_ = state_ptr(a, "kv", a.integer("batch") * heads_ * F_ * dv_);
    z_ = state_ptr(a, "z", a.integer("batch") * heads_ * F_);
    rope_f_c_ = maybe_buffer(a, "feature_rope_cos");
    rope_f_s_ = maybe_buffer(a, "feature_rope_sin");
  }

  void check(const StepInfo& info) const override { phi_.check(info); }

 protected:
  size_t row_scratch(const StepInfo&) const override { return 4 * F_ + phi_.work() + 16; }

  void mix(const StepInfo& info, int64_t b, int64_t h, float* q, float* k, float* v, float* o, float* tmp) override {
    float* fq = tmp;
    float* fk = fq + F_;
    float* qr = fk + F_;
    float* kr = qr + F_;
    float* work = kr + F_;
    phi_.features(q, true, info.pos[b], fq, work);
    phi_.features(k, false, info.pos[b], fk, work);
    if (rope_f_c_.defined()) {
      const float* c = rope_f_c_.p + b * rope_f_c_.ld;
      const float* s = rope_f_s_.p + b * rope_f_s_.ld;
      rotate(fq, c, s, qr, F_, phi_.rounder());
      rotate(fk, c, s, kr, F_, phi_.rounder());
    } else {
      qr = fq;
      kr = fk;
    }
    const int64_t row = b * heads_ + h;
    float* kv = kv_ + row * F_ * dv_;
    float* z = z_ + row * F_;
    decay_update_row<float>(kv, kv, qr, kr, v, nullptr, false, o, F_, dv_);
    float den = 0;
    for (int64_t f = 0; f < F_; ++f) {
      z[f] += fk[f];
      den += fq[f] * z[f];
    }
    const float inv = normalize_ ? 1.0f / (den + eps_) : 1.0f;
    for (int64_t e = 0; e < dv_; ++e) o[e] = R_(o[e] * inv);
  }

 private:
  FeatureMap phi_;
  int64_t F_;
  bool normalize_;
  float eps_;
  at::Tensor state_, z_t_;
  float* kv_;
  float* z_;
  Buffer rope_f_c_, rope_f_s_;
};

// S = diag(e^g) S + k vᵀ, o = Sᵀ q (rounded as the eager output) for one (row, head): g the n log-decays
// of the row (1, or one per key feature: D), made e^g in place
inline void gated_row(float* S, const float* q, const float* k, const float* v, float* g, int64_t n, float* o,
                      int64_t D, int64_t E, const Rounder& R) {
  for (int64_t i = 0; i < n; ++i) g[i] = exp_nonpositive(g[i]);
  decay_update_row<float>(S, S, q, k, v, g, n > 1, o, D, E);
  for (int64_t e = 0; e < E; ++e) o[e] = R(o[e]);
}

// RetNet, simple GLA, GLA: S = diag(e^g) S + k vᵀ, o = Sᵀ (q · D^{−1/2}); HGRN2 (tied_input): g =
// logsigmoid of the k block (the key decay), k ← 1 − e^g, q ← SiLU(q), then RoPE
class GatedMixOp : public AttentionMixOp {
 public:
  GatedMixOp(const Args& a, bool bf16)
      : AttentionMixOp(a, bf16), decay_(Decay::from(a)), scale_(static_cast<float>(a.real("scale"))),
        tied_input_(a.integer("tied_input", 0) != 0) {
    TORCH_CHECK(tied_input_ == (decay_.kind == kKeyDecay), "linattn_cpu::DecodePlan: the gated mixer's key decay "
                "goes with the tied input gate (HGRN2)");
    state_t_ = a.tensor("state");
    S_ = state_ptr(a, "state", a.integer("batch") * heads_ * dq_ * dv_);
    rotates_itself_ = tied_input_;  // the gate reads k before RoPE
  }

 protected:
  size_t row_scratch(const StepInfo&) const override { return 2 * dq_ + 16; }

  void mix(const StepInfo&, int64_t b, int64_t h, float* q, float* k, float* v, float* o, float* tmp) override {
    float* g = tmp;
    const int64_t n = decay_.log_decay(b, h, dq_, R_, g, k);
    if (tied_input_) {  // as linattn.nn.hgrn2.HGRN2Attention.mix
      for (int64_t i = 0; i < dq_; ++i) {
        k[i] = R_(-std::expm1(g[i]));
        q[i] = R_(silu(q[i]));
      }
      rotate_qk(b, q, k, tmp + dq_);
    }
    for (int64_t i = 0; i < dq_; ++i) q[i] = R_(q[i] * scale_);
    gated_row(S_ + (b * heads_ + h) * dq_ * dv_, q, k, v, g, n, o, dq_, dv_, R_);
  }

 private:
  Decay decay_;
  float scale_;
  bool tied_input_;
  at::Tensor state_t_;
  float* S_;
};

// DeltaNet, Gated DeltaNet: SiLU on q, k, v; β = sigmoid(W_β x); q̂, k̂ L2-normalized; the delta rule
class DeltaMixOp : public AttentionMixOp {
 public:
  DeltaMixOp(const Args& a, bool bf16)
      : AttentionMixOp(a, bf16), beta_(buffer(a, "beta")), decay_(Decay::from(a)),
        scale_(static_cast<float>(a.real("scale"))), beta_scale_(static_cast<float>(a.real("beta_scale", 1.0))) {
    state_t_ = a.tensor("state");
    S_ = state_ptr(a, "state", a.integer("batch") * heads_ * dq_ * dv_);
  }

 protected:
  size_t row_scratch(const StepInfo&) const override { return 3 * dq_ + 2 * dv_ + 16; }

  void activate(float* q, float* k, float* v) override {
    for (int64_t i = 0; i < dq_; ++i) q[i] = R_(silu(q[i]));
    for (int64_t i = 0; i < dq_; ++i) k[i] = R_(silu(k[i]));
    for (int64_t i = 0; i < dv_; ++i) v[i] = R_(silu(v[i]));
  }

  void run(const StepInfo& info, int tid, int threads, float* scratch) override {
    const FlushDenormals flush;  // α S with α = e^g tiny: as delta.cpp's step
    AttentionMixOp::run(info, tid, threads, scratch);
  }

  void mix(const StepInfo&, int64_t b, int64_t h, float* q, float* k, float* v, float* o, float* tmp) override {
    float* qk = tmp;
    for (int part = 0; part < 2; ++part) {  // q̂, k̂ = x / √(‖x‖² + ε)
      const float* x = part == 0 ? q : k;
      float ss = 0;
      for (int64_t i = 0; i < dq_; ++i) ss += x[i] * x[i];
      const float r = inverse_norm(x, dq_, ss);
      for (int64_t i = 0; i < dq_; ++i) qk[part * dq_ + i] = x[i] * r;
    }
    // β = sigmoid(W_β x), times 2 with allow_neg_eigval (β ∈ (0, 2))
    const float beta = std::max(sigmoid(beta_.p[b * beta_.ld + h]), FLT_MIN) * beta_scale_;
    float* S = S_ + (b * heads_ + h) * dq_ * dv_;
    if (decay_.kind == kChannelDecay) {  // KDA: α = e^g per key channel, S' = (I − β k̂k̂ᵀ) Diag(α) S + β k̂ vᵀ
      float* alpha = qk + 2 * dq_;
      decay_.log_decay(b, h, dq_, R_, alpha);
      for (int64_t i = 0; i < dq_; ++i) alpha[i] = exp_nonpositive(alpha[i]);
      delta_row<float, float, true>(S, S, qk, v, beta, alpha, scale_, o, dq_, dv_);
    } else {
      float g = 0;
      if (decay_.kind != kNoDecay) decay_.log_decay(b, h, 1, R_, &g);
      delta_update_row<float, float>(S, S, qk, v, beta, decay_.kind != kNoDecay ? std::exp(g) : 1.0f, scale_, o, dq_,
                                     dv_);
    }
    for (int64_t e = 0; e < dv_; ++e) o[e] = R_(o[e]);
  }

 private:
  Buffer beta_;
  Decay decay_;
  float scale_, beta_scale_;
  at::Tensor state_t_;
  float* S_;
};

// ----------------------------------------------------------------------------------------------
// softmax attention over the KV cache

// The scores s_j = q·k_j·scale of the n keys of K (n × D) that seen(j) keeps, and their largest into top
template <typename T, class Seen>
inline void key_scores(const T* K, const float* q, int64_t D, int64_t n, float scale, const Seen& seen, float* s,
                       float* top) {
  for (int64_t j = 0; j < n; ++j) {
    if (!seen(j)) continue;
    const T* kj = K + j * D;
    float dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < D; ++i) dot += q[i] * static_cast<float>(kj[i]);
    s[j] = dot * scale;
    *top = std::max(*top, s[j]);
  }
}

// Softmax attention of one query over n cached keys and values (rows base_k / D and base_v / E on of
// the K and V tensors, float or bf16): acc (E) = Σ_j e^{s_j − m} v_j and the returned Σ_j e^{s_j − m},
// over the keys j that seen(j) keeps, s_j = q·k_j·scale, m their largest; s: n floats of scratch.
// The softmax mixer's KV cache and the window mixer's ring buffer (model_window.h).
template <class Seen>
inline float attend(const Held& K, const Held& V, int64_t base_k, int64_t base_v, const float* q, int64_t n, int64_t D,
                    int64_t E, float scale, const Seen& seen, float* s, float* acc) {
  float top = -INFINITY;
  if (K.bf16) {
    key_scores(static_cast<const at::BFloat16*>(K.p) + base_k, q, D, n, scale, seen, s, &top);
  } else {
    key_scores(static_cast<const float*>(K.p) + base_k, q, D, n, scale, seen, s, &top);
  }
  for (int64_t e = 0; e < E; ++e) acc[e] = 0;
  float sum = 0;
  const at::BFloat16* vh = static_cast<const at::BFloat16*>(V.p) + base_v;
  const float* vf = static_cast<const float*>(V.p) + base_v;
  for (int64_t j = 0; j < n; ++j) {
    if (!seen(j)) continue;
    const float p = exp_nonpositive(s[j] - top);
    sum += p;
    if (V.bf16) {
      const at::BFloat16* vj = vh + j * E;
      for (int64_t e = 0; e < E; ++e) acc[e] += p * static_cast<float>(vj[e]);
    } else {
      const float* vj = vf + j * E;
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) acc[e] += p * vj[e];
    }
  }
  return sum;
}

class SoftmaxMixOp : public AttentionMixOp {
 public:
  SoftmaxMixOp(const Args& a, bool bf16)
      : AttentionMixOp(a, bf16), k_(a.tensor("k_cache")), v_(a.tensor("v_cache")),
        scale_(static_cast<float>(1.0 / std::sqrt(double(dq_)))) {
    TORCH_CHECK(k_.t.dim() == 4 && v_.t.dim() == 4 && k_.t.size(1) == heads_ && k_.t.size(3) == dq_ &&
                    v_.t.size(3) == dv_ && v_.t.size(2) == k_.t.size(2),
                "linattn_cpu::DecodePlan: KV cache of the wrong shape");
    if (a.has("key_mask")) {
      mask_ = a.tensor("key_mask");
      TORCH_CHECK(mask_.scalar_type() == at::kBool && mask_.is_contiguous() && mask_.size(1) == k_.t.size(2),
                  "linattn_cpu::DecodePlan: bad key mask");
    }
  }

  void check(const StepInfo& info) const override {
    TORCH_CHECK(info.length < k_.t.size(2), "linattn_cpu::DecodePlan: the KV cache is full (", k_.t.size(2),
                " tokens); grow it before the step");
  }

 protected:
  size_t row_scratch(const StepInfo& info) const override { return info.length + 1 + 2 * dv_ + 16; }

  void mix(const StepInfo& info, int64_t b, int64_t h, float* q, float* k, float* v, float* o, float* tmp) override {
    const int64_t cap = k_.t.size(2), T = info.length + 1;
    const int64_t base_k = (b * heads_ + h) * cap * dq_, base_v = (b * heads_ + h) * cap * dv_;
    for (int64_t i = 0; i < dq_; ++i) k_.set(base_k + info.length * dq_ + i, k[i]);
    for (int64_t i = 0; i < dv_; ++i) v_.set(base_v + info.length * dv_ + i, v[i]);
    const bool* keep = mask_.defined() ? mask_.data_ptr<bool>() + b * cap : nullptr;
    if (keep != nullptr && h == 0) mask_.data_ptr<bool>()[b * cap + info.length] = true;
    const int64_t length = info.length;
    const auto seen = [keep, length](int64_t j) { return keep == nullptr || j >= length || keep[j]; };
    float* acc = tmp + T;
    const float sum = attend(k_, v_, base_k, base_v, q, T, dq_, dv_, scale_, seen, tmp, acc);
    for (int64_t e = 0; e < dv_; ++e) o[e] = R_(acc[e] / sum);
  }

 private:
  Held k_, v_;
  at::Tensor mask_;
  float scale_;
};

}  // namespace
