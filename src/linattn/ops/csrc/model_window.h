// The window family's mixer of the fused decoding step ("window": the kinds swa, lolcats and liger of
// linattn.models.kinds; the other families' mixers are in model_mixers.h), per (batch row, head), on the
// layer's ring buffer of the last W keys and values (linattn.ops.swa.WindowState: token t in slot t mod W,
// in the model's dtype; the ring's token count t is the step's `length` plus `ring_offset`, the
// difference the layer found between the ring's count and its cache's when the plan was built: 0, but
// for a cache whose position counters were moved on alone, as linattn bench decode's are):
//
//   swa      the new k, v into slot t mod W; o = softmax(q·K/√D) V over the filled slots whose keys are
//            real (a slot of a padded prompt token is not)                          (linattn.ops.swa)
//   lolcats  first the token in that slot (t − W) leaves the window into the linear state, kv += φ_k(k)ᵀ v,
//            z += φ_k(k) (φ_k(k) is kept in the ring beside k, zero for padded keys); the new φ_k(k) into
//            its slot; o = (γ_h Σ e^{s−m} v + φ_q(q)ᵀ kv) / (γ_h Σ e^{s−m} + φ_q(q)·z), s = q·K/√D over
//            the window, m its largest, γ_h = sigmoid(θ_h)                      (linattn.ops.swa.hybrid)
//   liger    the gated recurrence on softmax(q), softmax(k) of the unrotated q, k, g = logsigmoid(k)/16
//            (the key decay, model_decay.h): S = diag(e^g) S + φ(k) vᵀ, o_g = Sᵀ φ(q); then the window
//            on the rotated q, k; o = (o_w + o_g) / 2                                 (linattn.nn.liger)
//
// q, k rotated by RoPE where the layer has it (the feature maps read the rotated q, k, as LoLCATs'
// layer does). Values as the eager steps compute them (model_ops.h's roundings). Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "model_decay.h"
#include "model_features.h"
#include "model_mixers.h"

namespace {

// what the tokens beyond the window go to: nothing (swa), a linear state (lolcats), a gated state (liger)
enum WindowBeyond { kBeyondNothing = 0, kBeyondLinear = 1, kBeyondGated = 2 };

class WindowMixOp : public AttentionMixOp {
 public:
  WindowMixOp(const Args& a, bool bf16)
      : AttentionMixOp(a, bf16), k_(a.tensor("window_k")), v_(a.tensor("window_v")),
        beyond_(static_cast<int>(a.integer("beyond", kBeyondNothing))), ring_offset_(a.integer("ring_offset", 0)),
        scale_(static_cast<float>(1.0 / std::sqrt(double(dq_)))) {
    const int64_t B = a.integer("batch");
    W_ = k_.t.dim() == 4 ? k_.t.size(2) : 0;
    TORCH_CHECK(k_.t.dim() == 4 && v_.t.dim() == 4 && k_.t.size(0) == B && k_.t.size(1) == heads_ && W_ > 0 &&
                    k_.t.size(3) == dq_ && v_.t.size(0) == B && v_.t.size(1) == heads_ && v_.t.size(2) == W_ &&
                    v_.t.size(3) == dv_,
                "linattn_cpu::DecodePlan: window ring buffer of the wrong shape");
    if (a.has("window_valid")) {
      valid_ = a.tensor("window_valid");
      TORCH_CHECK(valid_.scalar_type() == at::kBool && valid_.is_contiguous() && valid_.numel() == B * W_,
                  "linattn_cpu::DecodePlan: bad window validity mask");
    }
    if (beyond_ == kBeyondLinear) {
      phi_q_ = FeatureMap(a, dq_, bf16, "q_");
      phi_k_ = FeatureMap(a, dq_, bf16, "k_");
      F_ = phi_q_.dim();
      kf_ = Held(a.tensor("window_kf"));
      TORCH_CHECK(phi_k_.dim() == F_ && kf_.t.numel() == B * heads_ * W_ * F_,
                  "linattn_cpu::DecodePlan: φ_q, φ_k and the ring's key features must have one feature dim");
      kv_t_ = a.tensor("kv");
      z_t_ = a.tensor("z");
      kv_ = state_ptr(a, "kv", B * heads_ * F_ * dv_);
      z_ = state_ptr(a, "z", B * heads_ * F_);
      gamma_ = a.tensor("window_factor").to(at::kFloat).contiguous();
      TORCH_CHECK(gamma_.numel() == heads_, "linattn_cpu::DecodePlan: one window factor per head");
    } else if (beyond_ == kBeyondGated) {
      decay_ = Decay::from(a);
      TORCH_CHECK(decay_.kind == kKeyDecay, "linattn_cpu::DecodePlan: the window's gated state takes the key decay");
      S_t_ = a.tensor("state");
      S_ = state_ptr(a, "state", B * heads_ * dq_ * dv_);
      rotates_itself_ = true;  // the gated part reads q, k before RoPE
    } else {
      TORCH_CHECK(beyond_ == kBeyondNothing, "linattn_cpu::DecodePlan: unknown window 'beyond' ", beyond_);
    }
  }

  void check(const StepInfo& info) const override {
    TORCH_CHECK(info.length + ring_offset_ >= 0, "linattn_cpu::DecodePlan: the ring buffer's count went negative");
    if (beyond_ != kBeyondLinear) return;
    phi_q_.check(info);
    phi_k_.check(info);
  }

 protected:
  // the scores (W), the window's sums (E), then the beyond part's: φ_q(q), φ_k(k) and the maps' work, or
  // softmax(q), softmax(k), g (3·D), o_g (E) and RoPE's D
  size_t row_scratch(const StepInfo&) const override {
    const int64_t linear = 2 * F_ + std::max(phi_q_.work(), phi_k_.work());
    const int64_t gated = 4 * dq_ + dv_;
    return W_ + dv_ + 32 + (beyond_ == kBeyondLinear ? linear : beyond_ == kBeyondGated ? gated : 0);
  }

  void mix(const StepInfo& info, int64_t b, int64_t h, float* q, float* k, float* v, float* o, float* tmp) override {
    float* s = tmp;
    float* acc = s + W_;
    float* extra = acc + dv_ + 16;
    const int64_t row = b * heads_ + h, t = info.length + ring_offset_, slot = t % W_;
    if (beyond_ == kBeyondGated) {
      gated(b, h, q, k, v, extra);  // o_g into extra[3D, 3D + E)
      rotate_qk(b, q, k, extra + 3 * dq_ + dv_);
    } else if (beyond_ == kBeyondLinear) {
      float* fk = extra + F_;
      if (t >= W_) evict(row, slot);
      phi_q_.features(q, true, info.pos[b], extra, fk + F_);
      phi_k_.features(k, false, info.pos[b], fk, fk + F_);
      for (int64_t f = 0; f < F_; ++f) kf_.set((row * W_ + slot) * F_ + f, fk[f]);
    }
    const int64_t base_k = row * W_ * dq_, base_v = row * W_ * dv_;
    for (int64_t i = 0; i < dq_; ++i) k_.set(base_k + slot * dq_ + i, k[i]);
    for (int64_t i = 0; i < dv_; ++i) v_.set(base_v + slot * dv_ + i, v[i]);
    // the new key is real (a decoded token); head 0 marks it, the other heads never read its flag
    bool* real = valid_.defined() ? valid_.data_ptr<bool>() + b * W_ : nullptr;
    if (real != nullptr && h == 0) real[slot] = true;
    const auto seen = [real, slot](int64_t j) { return real == nullptr || j == slot || real[j]; };
    const int64_t filled = std::min(t + 1, W_);  // slots t + 1 … W − 1 are empty while t + 1 < W
    const float sum = attend(k_, v_, base_k, base_v, q, filled, dq_, dv_, scale_, seen, s, acc);
    if (beyond_ == kBeyondLinear) {
      linear_out(row, h, extra, acc, sum, o);
    } else if (beyond_ == kBeyondGated) {
      const float* og = extra + 3 * dq_;
      for (int64_t e = 0; e < dv_; ++e) o[e] = R_(R_(acc[e] / sum) + og[e]) * 0.5f;  // the mean of two bf16 outputs
    } else {
      for (int64_t e = 0; e < dv_; ++e) o[e] = R_(acc[e] / sum);
    }
  }

 private:
  // LoLCATs: the token of `slot` leaves the window: kv += φ_k(k) vᵀ, z += φ_k(k). A padded key's φ_k(k) is
  // zero in the ring, so it adds nothing (the eager step also zeroes its v)
  void evict(int64_t row, int64_t slot) {
    float* kv = kv_ + row * F_ * dv_;
    float* z = z_ + row * F_;
    const int64_t kf0 = (row * W_ + slot) * F_, v0 = (row * W_ + slot) * dv_;
    for (int64_t f = 0; f < F_; ++f) {
      const float kf = kf_.get(kf0 + f);
      z[f] += kf;
      for (int64_t e = 0; e < dv_; ++e) kv[f * dv_ + e] += kf * v_.get(v0 + e);
    }
  }

  // LoLCATs' output: (γ_h Σ e^{s−m} v + φ_q(q)ᵀ kv) / (γ_h Σ e^{s−m} + φ_q(q)·z), the linear part's factor 1
  void linear_out(int64_t row, int64_t h, const float* fq, const float* acc, float sum, float* o) const {
    const float gamma = gamma_.data_ptr<float>()[h];
    const float* kv = kv_ + row * F_ * dv_;
    const float* z = z_ + row * F_;
    float den = gamma * sum;
    for (int64_t e = 0; e < dv_; ++e) o[e] = gamma * acc[e];
    for (int64_t f = 0; f < F_; ++f) {
      den += fq[f] * z[f];
      const float* kvf = kv + f * dv_;
#pragma omp simd
      for (int64_t e = 0; e < dv_; ++e) o[e] += fq[f] * kvf[e];
    }
    for (int64_t e = 0; e < dv_; ++e) o[e] = R_(o[e] / den);
  }

  // Liger's gated part on the unrotated q, k: work holds softmax(q), softmax(k), g (3·D), then o_g (E)
  void gated(int64_t b, int64_t h, const float* q, const float* k, const float* v, float* work) {
    float* fq = work;
    float* fk = fq + dq_;
    float* g = fk + dq_;
    softmax_row(q, 1.0f, dq_, fq, R_);
    softmax_row(k, 1.0f, dq_, fk, R_);
    const int64_t n = decay_.log_decay(b, h, dq_, R_, g, k);
    gated_row(S_ + (b * heads_ + h) * dq_ * dv_, fq, fk, v, g, n, g + dq_, dq_, dv_, R_);
  }

  Held k_, v_;
  int beyond_;
  int64_t ring_offset_;
  float scale_;
  int64_t W_ = 0;
  at::Tensor valid_;
  // lolcats
  FeatureMap phi_q_, phi_k_;
  int64_t F_ = 0;
  Held kf_;
  at::Tensor kv_t_, z_t_, gamma_;
  float* kv_ = nullptr;
  float* z_ = nullptr;
  // liger
  Decay decay_;
  at::Tensor S_t_;
  float* S_ = nullptr;
};

}  // namespace
