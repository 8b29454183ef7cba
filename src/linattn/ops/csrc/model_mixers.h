// The attention of one layer for one decoded token (model_step.cpp), per (batch row, head), after the
// layer's fused q|k|v projection (and the output gate's, β's and the decays' projections, done by the
// matvec group before it; the decays: model_decay.h): the short convolution over the head's q, k, v
// channels with its cache tail, then the kind's recurrence on its cached state, in place, then the
// per-head output norm and gate, into the buffer the output projection reads.
//
//   linear           φ (elu, relu, favor, trig, cosformer, taylor, hedgehog), RoPE on the features,
//                    kv += k̃ᵣ vᵀ, z += k̃, o = q̃ᵣᵀ kv / (q̃ · z + ε)                        (design §3–6)
//   gated            q·D^{−1/2}, S = diag(e^g) S + k vᵀ, o = Sᵀ q; g RetNet's, Mamba2's or GLA's (§8, §12)
//   delta            SiLU, S = α (I − β k̂k̂ᵀ) S + β k̂ vᵀ, o = D^{−1/2} Sᵀ q̂                        (§13)
//                    (KDA: S = (I − β k̂k̂ᵀ) Diag(α) S + β k̂ vᵀ, α per key channel, §13.8)
//   softmax          the new k, v appended to the KV cache, o = softmax(q·K/√D) V                   (§8)
//
// Each computes what linattn's eager layers compute, in float, with the bf16 roundings of a bf16 model
// where the eager path holds bf16 tensors (model_ops.h). Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model_decay.h"
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
      if (rope_c_.defined()) {
        rotate(q, rope_c_.p + b * rope_c_.ld, rope_s_.p + b * rope_s_.ld, tmp, rope_dim_, R_);
        std::copy(tmp, tmp + rope_dim_, q);
        rotate(k, rope_c_.p + b * rope_c_.ld, rope_s_.p + b * rope_s_.ld, tmp, rope_dim_, R_);
        std::copy(tmp, tmp + rope_dim_, k);
      }
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

  Buffer qkv_, o_;
  int64_t heads_, dq_, dv_;
  Rounder R_;

 private:
  at::Tensor conv_w_;
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
// linear attention with a feature map

enum FeatureMap { kElu = 1, kReLU = 2, kFavor = 3, kTrig = 4, kCosFormer = 5, kTaylor = 6, kHedgehog = 7 };

class LinearMixOp : public AttentionMixOp {
 public:
  LinearMixOp(const Args& a, bool bf16)
      : AttentionMixOp(a, bf16), map_(static_cast<int>(a.integer("feature_map"))), F_(a.integer("feature_dim")),
        normalize_(a.integer("normalize") != 0), eps_(static_cast<float>(a.real("eps"))),
        Rf_{bf16 && a.integer("features_bf16") != 0} {
    state_ = a.tensor("kv");
    z_t_ = a.tensor("z");
    kv_ = state_ptr(a, "kv", a.integer("batch") * heads_ * F_ * dv_);
    z_ = state_ptr(a, "z", a.integer("batch") * heads_ * F_);
    rope_f_c_ = maybe_buffer(a, "feature_rope_cos");
    rope_f_s_ = maybe_buffer(a, "feature_rope_sin");
    map_eps_ = static_cast<float>(a.real("map_eps", 0.0));
    max_len_ = a.integer("max_len", 0);
    stabilize_ = a.integer("stabilize", 0) != 0;
    if (a.has("projection")) {  // FAVOR+ / trig ω, Hedgehog's W: (m, D)
      proj_ = a.tensor("projection").to(at::kFloat).contiguous();
      m_ = proj_.size(0);
      if (map_ == kFavor) pair_shift();
    }
  }

  void check(const StepInfo& info) const override {
    if (map_ != kCosFormer) return;
    for (int64_t b = 0; b < info.batch; ++b) {
      TORCH_CHECK_VALUE(info.pos[b] >= 0 && info.pos[b] < max_len_, "cosFormer positions must lie in [0, max_len=",
                        max_len_, "), got ", info.pos[b]);
    }
  }

 protected:
  size_t row_scratch(const StepInfo&) const override { return 4 * F_ + m_ + dq_ + 16; }

  void mix(const StepInfo& info, int64_t b, int64_t h, float* q, float* k, float* v, float* o, float* tmp) override {
    float* fq = tmp;
    float* fk = fq + F_;
    float* qr = fk + F_;
    float* kr = qr + F_;
    float* work = kr + F_;
    features(q, true, info.pos[b], fq, work);
    features(k, false, info.pos[b], fk, work);
    if (rope_f_c_.defined()) {
      const float* c = rope_f_c_.p + b * rope_f_c_.ld;
      const float* s = rope_f_s_.p + b * rope_f_s_.ld;
      rotate(fq, c, s, qr, F_, Rf_);
      rotate(fk, c, s, kr, F_, Rf_);
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
  // φ(x) of one head (x: D values) into f (F values), as linattn.feature_maps computes it
  void features(const float* x, bool is_query, int64_t pos, float* f, float* work) const {
    const int64_t D = dq_;
    const Rounder& R = Rf_;
    switch (map_) {
      case kElu:
        for (int64_t i = 0; i < D; ++i) f[i] = R(R(exp_nonpositive(std::min(x[i], 0.0f))) + std::max(x[i], 0.0f));
        break;
      case kReLU:
        for (int64_t i = 0; i < D; ++i) f[i] = map_eps_ != 0 ? R(std::max(x[i], 0.0f) + map_eps_) : std::max(x[i], 0.0f);
        break;
      case kFavor:
      case kTrig: {
        const float sq = project(x, work, work + m_);  // work: ω x' (m), sq = ‖x'‖²/2
        const int64_t m = m_;
        if (map_ == kTrig) {
          const float root = std::sqrt(float(m)), grow = (!is_query || !stabilize_) ? std::exp(sq) : 1.0f;
          for (int64_t i = 0; i < m; ++i) {
            f[i] = std::sin(work[i]) / root * grow;
            f[m + i] = std::cos(work[i]) / root * grow;
          }
        } else if (!stabilize_) {
          const float root = std::sqrt(float(m));
          for (int64_t i = 0; i < m; ++i) f[i] = std::exp(work[i] - sq) / root;
        } else if (is_query) {  // shifted by the logsumexp of its exponents: features summing to 1
          float top = -INFINITY;
          for (int64_t i = 0; i < m; ++i) top = std::max(top, work[i] = (work[i] - sq) + shift_[i]);
          float sum = 0;
          for (int64_t i = 0; i < m; ++i) sum += std::exp(work[i] - top);
          const float lse = top + std::log(sum);
          for (int64_t i = 0; i < m; ++i) f[i] = std::exp(work[i] - lse);
        } else {
          for (int64_t i = 0; i < m; ++i) f[i] = std::exp(((work[i] - sq) - shift_[i]) + shift_mean_);
        }
        break;
      }
      case kCosFormer: {
        const float ang = static_cast<float>(pos) * static_cast<float>(M_PI / (2.0 * double(max_len_)));
        const float c = R(std::cos(ang)), s = R(std::sin(ang));
        for (int64_t i = 0; i < D; ++i) {
          const float r = std::max(x[i], 0.0f);
          f[i] = R(r * c);
          f[D + i] = R(r * s);
        }
        break;
      }
      case kTaylor: {
        const float a = static_cast<float>(std::pow(double(D), -0.25)), c = static_cast<float>(1.0 / std::sqrt(2.0 * D));
        f[0] = 1.0f;
        for (int64_t i = 0; i < D; ++i) f[1 + i] = R(x[i] * a);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) f[1 + D + i * D + j] = R(R(x[i] * x[j]) * c);
        break;
      }
      case kHedgehog: {
        const int64_t m = m_;
        const float* W = proj_.data_ptr<float>();
        for (int64_t i = 0; i < m; ++i) {
          float y = 0;
          for (int64_t j = 0; j < D; ++j) y += x[j] * W[i * D + j];
          work[i] = R(y);
        }
        for (int sign = 0; sign < 2; ++sign) {  // softmax(Wx), then softmax(−Wx)
          const float s = sign == 0 ? 1.0f : -1.0f;
          float top = -INFINITY, sum = 0;
          for (int64_t i = 0; i < m; ++i) top = std::max(top, s * work[i]);
          for (int64_t i = 0; i < m; ++i) sum += std::exp(s * work[i] - top);
          for (int64_t i = 0; i < m; ++i) f[sign * m + i] = R(std::exp(s * work[i] - top) / sum);
        }
        break;
      }
      default:
        break;
    }
  }

  // FAVOR+ / trig: out = ω x' with x' = x·D^{−1/4} (into xs, D values); returns ‖x'‖²/2
  float project(const float* x, float* out, float* xs) const {
    const int64_t D = dq_;
    const float a = static_cast<float>(std::pow(double(D), -0.25));
    float sq = 0;
    for (int64_t i = 0; i < D; ++i) {
      xs[i] = x[i] * a;
      sq += xs[i] * xs[i];
    }
    const float* W = proj_.data_ptr<float>();
    for (int64_t i = 0; i < m_; ++i) {
      float y = 0;
      for (int64_t j = 0; j < D; ++j) y += xs[j] * W[i * D + j];
      out[i] = y;
    }
    return 0.5f * sq;
  }

  // FAVOR+'s stabilizer (linattn.feature_maps.FavorPlus._pair_shift): h_i = ‖ω_i‖²/2 raised to the larger
  // of each RoPE pair (i, i + ⌊m/2⌋), and the keys' constant min(30, mean h')
  void pair_shift() {
    const int64_t m = m_, D = dq_, p = m / 2;
    const float* W = proj_.data_ptr<float>();
    std::vector<float> half(m);
    for (int64_t i = 0; i < m; ++i) {
      float s = 0;
      for (int64_t j = 0; j < D; ++j) s += W[i * D + j] * W[i * D + j];
      half[i] = 0.5f * s;
    }
    shift_.assign(half.begin(), half.end());
    for (int64_t i = 0; i < p; ++i) shift_[i] = shift_[i + p] = std::max(half[i], half[i + p]);
    double mean = 0;
    for (float s : shift_) mean += s;
    shift_mean_ = std::min(static_cast<float>(mean / double(m)), 30.0f);
  }

  int map_;
  int64_t F_;
  bool normalize_;
  float eps_;
  Rounder Rf_;  // the features' roundings: bf16 for the maps whose features the eager path keeps in bf16
  at::Tensor state_, z_t_;
  float* kv_;
  float* z_;
  Buffer rope_f_c_, rope_f_s_;
  float map_eps_ = 0;
  int64_t max_len_ = 0;
  bool stabilize_ = false;
  at::Tensor proj_;
  int64_t m_ = 0;
  std::vector<float> shift_;
  float shift_mean_ = 0;
};

// RetNet, simple GLA, GLA: S = diag(e^g) S + k vᵀ, o = Sᵀ (q · D^{−1/2})
class GatedMixOp : public AttentionMixOp {
 public:
  GatedMixOp(const Args& a, bool bf16)
      : AttentionMixOp(a, bf16), decay_(Decay::from(a)), scale_(static_cast<float>(a.real("scale"))) {
    state_t_ = a.tensor("state");
    S_ = state_ptr(a, "state", a.integer("batch") * heads_ * dq_ * dv_);
  }

 protected:
  size_t row_scratch(const StepInfo&) const override { return 2 * dq_ + 16; }

  void mix(const StepInfo&, int64_t b, int64_t h, float* q, float* k, float* v, float* o, float* tmp) override {
    for (int64_t i = 0; i < dq_; ++i) q[i] = R_(q[i] * scale_);
    float* a = tmp;
    const int64_t n = decay_.log_decay(b, h, dq_, R_, a);
    for (int64_t i = 0; i < n; ++i) a[i] = exp_nonpositive(a[i]);
    float* S = S_ + (b * heads_ + h) * dq_ * dv_;
    decay_update_row<float>(S, S, q, k, v, a, n > 1, o, dq_, dv_);
    for (int64_t e = 0; e < dv_; ++e) o[e] = R_(o[e]);
  }

 private:
  Decay decay_;
  float scale_;
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
    float* u = qk + 2 * dq_;
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
      float* alpha = u + dv_;
      decay_.log_decay(b, h, dq_, R_, alpha);
      for (int64_t i = 0; i < dq_; ++i) alpha[i] = exp_nonpositive(alpha[i]);
      delta_row<float, float, true>(S, S, qk, v, beta, alpha, scale_, o, u, dq_, dv_);
    } else {
      float g = 0;
      if (decay_.kind != kNoDecay) decay_.log_decay(b, h, 1, R_, &g);
      delta_update_row<float, float>(S, S, qk, v, beta, decay_.kind != kNoDecay ? std::exp(g) : 1.0f, scale_, o, u,
                                     dq_, dv_);
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
    float* s = tmp;
    float* acc = tmp + T;
    float top = -INFINITY;
    if (k_.bf16) {
      scores(k_.t.data_ptr<at::BFloat16>() + base_k, q, keep, T, s, &top, info.length);
    } else {
      scores(k_.t.data_ptr<float>() + base_k, q, keep, T, s, &top, info.length);
    }
    for (int64_t e = 0; e < dv_; ++e) acc[e] = 0;
    float sum = 0;
    const at::BFloat16* vh = static_cast<const at::BFloat16*>(v_.p) + base_v;
    const float* vf = static_cast<const float*>(v_.p) + base_v;
    for (int64_t j = 0; j < T; ++j) {
      if (keep != nullptr && j < info.length && !keep[j]) continue;
      const float p = exp_nonpositive(s[j] - top);
      sum += p;
      if (v_.bf16) {
        const at::BFloat16* vj = vh + j * dv_;
        for (int64_t e = 0; e < dv_; ++e) acc[e] += p * static_cast<float>(vj[e]);
      } else {
        const float* vj = vf + j * dv_;
#pragma omp simd
        for (int64_t e = 0; e < dv_; ++e) acc[e] += p * vj[e];
      }
    }
    for (int64_t e = 0; e < dv_; ++e) o[e] = R_(acc[e] / sum);
  }

 private:
  template <typename T>
  void scores(const T* K, const float* q, const bool* keep, int64_t n, float* s, float* top, int64_t length) const {
    for (int64_t j = 0; j < n; ++j) {
      if (keep != nullptr && j < length && !keep[j]) continue;
      const T* kj = K + j * dq_;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < dq_; ++i) dot += q[i] * static_cast<float>(kj[i]);
      s[j] = dot * scale_;
      *top = std::max(*top, s[j]);
    }
  }

  Held k_, v_;
  at::Tensor mask_;
  float scale_;
};

// ----------------------------------------------------------------------------------------------
// The mixers by name: the plan's op of that name (linattn.models.kinds.FUSED_MIXERS, a kind's `fused`)
// is built by this table. A new fused mixer is its class above and one entry here.

using MixerFactory = std::unique_ptr<Op> (*)(const Args&, bool bf16);

template <class Mixer>
std::unique_ptr<Op> make_mixer(const Args& a, bool bf16) {
  return std::make_unique<Mixer>(a, bf16);
}

inline const std::map<std::string, MixerFactory>& mixer_table() {
  static const std::map<std::string, MixerFactory> table = {
      {"linear", make_mixer<LinearMixOp>},
      {"gated", make_mixer<GatedMixOp>},
      {"delta", make_mixer<DeltaMixOp>},
      {"softmax", make_mixer<SoftmaxMixOp>},
  };
  return table;
}

}  // namespace
