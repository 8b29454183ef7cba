// The log-decays of linattn.nn.decay (and KDA's forget gate, linattn.nn.kda.KDAForgetGate) in the fused
// decoding step's mixers (model_mixers.h), per (batch row, head), from the products the matvec groups
// wrote before the mixer:
//
//   fixed    RetNet       g_h = log(1 − 2^{−5−h})
//   scalar   Mamba2       g_h = −e^{A_log_h} · softplus((W_α x)_h + dt_bias_h)
//   feature  GLA          g_{h,f} = logsigmoid((W₂ W₁ x)_{h,f} + b_{h,f}) / τ                 (f < F)
//   channel  KDA          g_{h,d} = −e^{A_log_h} · softplus((F_b F_a x)_{h,d} + dt_bias_{h,d})  (d < D)
//   key      Liger, HGRN2 g_{h,d} = logsigmoid(k_{h,d}) / τ, from the head's own key (unrotated)  (d < D)
//
// in float, from the products rounded as the eager Linear's outputs are (bf16 models). Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "model_ops.h"

namespace {

enum DecayKind { kNoDecay = 0, kFixedDecay = 1, kScalarDecay = 2, kFeatureDecay = 3, kChannelDecay = 4, kKeyDecay = 5 };

struct Decay {
  int kind = kNoDecay;
  at::Tensor fixed;           // RetNet: g_h (H), float
  Buffer proj;                // Mamba2: W_α x (B, H); KDA: F_b F_a x (B, H·D); rounded as the eager Linear's output
  at::Tensor a_log, dt_bias;  // (H) floats; KDA's dt_bias (H·D)
  Buffer down;                // GLA: W₁ x (B, rank)
  at::Tensor up_w, up_b;      // W₂ (H·F, rank), b (H·F), floats
  float temperature = 1;      // GLA's and the key decay's τ

  static Decay from(const Args& a) {
    Decay d;
    d.kind = static_cast<int>(a.integer("decay", kNoDecay));
    if (d.kind == kFixedDecay) d.fixed = a.tensor("log_decay").to(at::kFloat).contiguous();
    if (d.kind == kScalarDecay || d.kind == kChannelDecay) {
      d.proj = buffer(a, "decay_proj");
      d.a_log = a.tensor("A_log").to(at::kFloat).contiguous();
      d.dt_bias = a.tensor("dt_bias").to(at::kFloat).contiguous();
    }
    if (d.kind == kFeatureDecay) {
      d.down = buffer(a, "decay_down");
      d.up_w = a.tensor("decay_up_weight").to(at::kFloat).contiguous();
      d.up_b = a.tensor("decay_up_bias").to(at::kFloat).contiguous();
      d.temperature = static_cast<float>(a.real("temperature"));
    }
    if (d.kind == kKeyDecay) d.temperature = static_cast<float>(a.real("temperature"));
    return d;
  }

  // g of head h at batch row b: one value (returns 1), or F values for GLA, KDA and the key decay (returns
  // F); key: the head's k (F values: the key decay's input)
  int64_t log_decay(int64_t b, int64_t h, int64_t F, const Rounder& R, float* g, const float* key = nullptr) const {
    if (kind == kFixedDecay) {
      g[0] = fixed.data_ptr<float>()[h];
      return 1;
    }
    if (kind == kScalarDecay) {  // g = −exp(A_log) · softplus(W_α x + dt_bias)
      const float a = proj.p[b * proj.ld + h] + dt_bias.data_ptr<float>()[h];
      g[0] = -std::exp(a_log.data_ptr<float>()[h]) * softplus(a);
      return 1;
    }
    if (kind == kChannelDecay) {  // KDA: g_d = −exp(A_log) · softplus((F_b F_a x)_d + dt_bias_d) per key channel
      const float* p = proj.p + b * proj.ld + h * F;
      const float* bias = dt_bias.data_ptr<float>() + h * F;
      const float a = -std::exp(a_log.data_ptr<float>()[h]);
      for (int64_t f = 0; f < F; ++f) g[f] = a * softplus(p[f] + bias[f]);
      return F;
    }
    if (kind == kKeyDecay) {  // g = logsigmoid(k) / τ, in float from the key as the eager layer holds it
      for (int64_t f = 0; f < F; ++f) g[f] = logsigmoid(key[f]) / temperature;
      return F;
    }
    // GLA: g = logsigmoid(W₂ W₁ x + b) / τ
    const int64_t rank = down.ld;
    const float* d = down.p + b * rank;
    const float* W = up_w.data_ptr<float>() + h * F * rank;
    const float* bias = up_b.data_ptr<float>() + h * F;
    for (int64_t f = 0; f < F; ++f) {
      float y = 0;
      for (int64_t r = 0; r < rank; ++r) y += W[f * rank + r] * d[r];
      g[f] = logsigmoid(R(y + bias[f])) / temperature;
    }
    return F;
  }
};

}  // namespace
