// The mixture-of-experts FFN of one decoded token (model_step.cpp's "moe" op; linattn.nn.moe.MoEFeedForward,
// Qwen3-Next's and Qwen3.5-MoE's), after the matvec group that computed the router's logits l = W_r u
// (and the shared expert's gate logit and output) of the normalized input u = Norm(x):
//
//   p = softmax(l) (float);  T = the top_k experts of p (ties: the lower index);  w_e = p_e, or
//   p_e / Σ_{e∈T} p_e with norm_topk_prob, rounded to the model's dtype
//   (router 1, Kimi Linear's: p = sigmoid(l) with l in float32, s = p + b; the n_group groups scored
//   by the sum of their two largest s, the topk_group best kept; T = the top_k experts of s there;
//   w_e = p_e (/ (Σ_{e∈T} p_e + 1e-20) with norm_topk_prob) · routed_scaling_factor)
//   h_e = silu(W_gate,e u) ⊙ W_up,e u                          (gate_up (E, 2F, d), F = d_expert)
//   y = Σ_{e∈T, by index} w_e · W_down,e h_e  (+ sigmoid(g_s) · shared, or + shared ungated)  (down (E, d, F))
//   out ← out + y (residual), or out ← y
//
// Two phases with a barrier between them: the k experts' hidden values of every row (the threads share
// the F columns), then their down products (the threads share the d output columns) summed in the
// eager path's order (the chosen experts by increasing index; a bf16 model rounds each term and sum as
// the eager index_add does). Every thread routes every row itself (B × E values: cheap, and no
// barrier). The expert matrices are read in place (fp32 or bf16; matvec.h). Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "model_ops.h"

namespace {

class MoEOp : public Op {
 public:
  MoEOp(const Args& a, bool bf16)
      : in_(buffer(a, "input")), norm_(NormSpec::from(a, "norm")), logits_(buffer(a, "logits")),
        hidden_(buffer(a, "hidden")), out_(buffer(a, "out")), k_(a.integer("top_k")),
        renorm_(a.integer("norm_topk_prob") != 0), residual_(a.integer("residual") != 0), R_{bf16} {
    const at::Tensor gate_up = a.tensor("gate_up"), down = a.tensor("down");
    TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3,
                "linattn_cpu::DecodePlan: moe: expert weights must be (E, ·, ·)");
    E_ = gate_up.size(0);
    F_ = down.size(2);
    d_ = in_.ld;
    TORCH_CHECK(gate_up.size(1) == 2 * F_ && gate_up.size(2) == d_ && down.size(0) == E_ && down.size(1) == d_ &&
                    logits_.ld == E_ && hidden_.ld == k_ * F_ && out_.ld == d_ && k_ >= 1 && k_ <= E_,
                "linattn_cpu::DecodePlan: moe: gate_up (E, 2F, d), down (E, d, F), logits (B, E), hidden (B, k·F), "
                "out (B, d) with 1 <= top_k <= E");
    for (int64_t e = 0; e < E_; ++e) {
      gate_up_.emplace_back(gate_up.select(0, e), false, at::Tensor());
      down_.emplace_back(down.select(0, e), false, at::Tensor());
    }
    shared_gate_ = maybe_buffer(a, "shared_gate");
    shared_out_ = maybe_buffer(a, "shared_out");
    TORCH_CHECK((!shared_gate_.defined() || shared_out_.defined()) && (!shared_out_.defined() || shared_out_.ld == d_),
                "linattn_cpu::DecodePlan: moe: the shared expert needs its output (B, d)");
    sigmoid_ = a.integer("router", 0) == 1;
    if (sigmoid_) {
      score_bias_ = a.tensor("score_bias").to(at::kFloat).contiguous();
      groups_ = a.integer("n_group");
      topk_group_ = a.integer("topk_group");
      scaling_ = static_cast<float>(a.real("routed_scaling_factor"));
      TORCH_CHECK(score_bias_.numel() == E_ && groups_ >= 1 && E_ % groups_ == 0 && E_ / groups_ >= 2 &&
                      topk_group_ >= 1 && topk_group_ <= groups_,
                  "linattn_cpu::DecodePlan: moe: bad sigmoid router");
    }
  }

  size_t scratch(const StepInfo& info) const override {
    return static_cast<size_t>(info.batch * (d_ + 2 * k_) + 3 * E_ + 2 * std::max(F_, d_) + 32);
  }

  void run(const StepInfo& info, int tid, int threads, float* scratch) override {
    const int64_t B = info.batch;
    float* xn = scratch;                   // (B, d) the normalized input
    float* experts = xn + B * d_;           // (B, k) the chosen experts, by increasing index
    float* weights = experts + B * k_;      // (B, k) their weights
    float* probs = weights + B * k_;        // (3E) the router's work
    float* y = probs + 3 * E_;              // 2 · max(F, d)
    for (int64_t b = 0; b < B; ++b) {
      norm_.apply(in_.p + b * d_, xn + b * d_, d_, R_);
      if (sigmoid_) {
        route_sigmoid(logits_.p + b * E_, probs, experts + b * k_, weights + b * k_);
      } else {
        route(logits_.p + b * E_, probs, experts + b * k_, weights + b * k_);
      }
    }
    int64_t f0, f1;
    share(F_, tid, threads, &f0, &f1);
    for (int64_t b = 0; b < B && f1 > f0; ++b) hidden_row(b, xn + b * d_, experts + b * k_, f0, f1, y);
#ifdef _OPENMP
    if (threads > 1) {  // every hidden value written, every thread done reading x (out may be x)
#pragma omp barrier
    }
#endif
    int64_t j0, j1;
    share(d_, tid, threads, &j0, &j1);
    for (int64_t b = 0; b < B && j1 > j0; ++b) output_row(b, experts + b * k_, weights + b * k_, j0, j1, y);
  }

 private:
  // columns [c0, c1) of n for thread tid: equal shares in multiples of 16
  static void share(int64_t n, int tid, int threads, int64_t* c0, int64_t* c1) {
    const int64_t units = (n + 15) / 16;
    *c0 = std::min(n, units * tid / threads * 16);
    *c1 = std::min(n, units * (tid + 1) / threads * 16);
  }

  // softmax of the E logits, the top k (ties: the lower index), their weights; sorted by expert index
  // (p is overwritten)
  void route(const float* l, float* p, float* experts, float* weights) const {
    float top = -INFINITY, sum = 0;
    for (int64_t e = 0; e < E_; ++e) top = std::max(top, l[e]);
    for (int64_t e = 0; e < E_; ++e) sum += p[e] = std::exp(l[e] - top);
    for (int64_t e = 0; e < E_; ++e) p[e] /= sum;
    const float total = pick(p, p, experts, weights);
    for (int64_t s = 0; s < k_; ++s) weights[s] = R_(renorm_ ? weights[s] / total : weights[s]);
  }

  // Kimi Linear's grouped sigmoid router (module comment); p: 3E floats of work
  void route_sigmoid(const float* l, float* p, float* experts, float* weights) const {
    float* s = p + E_;
    float* group = s + E_;  // the groups' scores (n_group)
    const float* bias = score_bias_.data_ptr<float>();
    for (int64_t e = 0; e < E_; ++e) s[e] = (p[e] = sigmoid(l[e])) + bias[e];
    const int64_t m = E_ / groups_;
    for (int64_t g = 0; g < groups_ && groups_ > 1; ++g) {  // the sum of the group's two largest s
      float a = -INFINITY, b = -INFINITY;
      for (int64_t e = g * m; e < (g + 1) * m; ++e) {
        if (s[e] > a) {
          b = a;
          a = s[e];
        } else if (s[e] > b) {
          b = s[e];
        }
      }
      group[g] = a + b;
    }
    for (int64_t t = 0; t < topk_group_ && groups_ > 1; ++t)  // the best groups marked +∞, the others' s −∞
      group[std::max_element(group, group + groups_) - group] = INFINITY;
    for (int64_t g = 0; g < groups_ && groups_ > 1; ++g)
      if (group[g] != INFINITY) std::fill(s + g * m, s + (g + 1) * m, -INFINITY);
    const float total = pick(s, p, experts, weights);
    for (int64_t k = 0; k < k_; ++k) weights[k] = R_((renorm_ ? weights[k] / (total + 1e-20f) : weights[k]) * scaling_);
  }

  // the top k of `score` (the largest left, the first of equals; then taken out), their weights
  // from p, sorted by expert index; returns the weights' sum
  float pick(float* score, const float* p, float* experts, float* weights) const {
    float total = 0;
    for (int64_t s = 0; s < k_; ++s) {
      const int64_t best = std::max_element(score, score + E_) - score;
      experts[s] = static_cast<float>(best);
      weights[s] = p[best];
      total += p[best];
      score[best] = -INFINITY;
    }
    for (int64_t s = 1; s < k_; ++s) {  // by increasing index (insertion sort of k pairs)
      for (int64_t t = s; t > 0 && experts[t - 1] > experts[t]; --t) {
        std::swap(experts[t - 1], experts[t]);
        std::swap(weights[t - 1], weights[t]);
      }
    }
    return total;
  }

  // hidden[b, s·F + f] = silu(gate_f) · up_f for the k experts of row b, f in [f0, f1)
  void hidden_row(int64_t b, const float* u, const float* experts, int64_t f0, int64_t f1, float* y) const {
    const int64_t n = f1 - f0;
    for (int64_t s = 0; s < k_; ++s) {
      const Weights& w = gate_up_[static_cast<int64_t>(experts[s])];
      matvec(w, u, 1, y, n, f0, f1, R_.bf16);
      matvec(w, u, 1, y + n, n, F_ + f0, F_ + f1, R_.bf16);
      float* h = hidden_.p + b * hidden_.ld + s * F_ + f0;
      for (int64_t f = 0; f < n; ++f) h[f] = R_(R_(silu(R_(y[f]))) * R_(y[n + f]));
    }
  }

  // out[b, j] (+)= Σ_s w_s · (W_down,e_s h_s)_j (+ sigmoid(g) · shared_j) for j in [j0, j1)
  void output_row(int64_t b, const float* experts, const float* weights, int64_t j0, int64_t j1, float* y) const {
    const int64_t n = j1 - j0;
    float* acc = y + n;
    std::fill(acc, acc + n, 0.0f);
    for (int64_t s = 0; s < k_; ++s) {
      matvec(down_[static_cast<int64_t>(experts[s])], hidden_.p + b * hidden_.ld + s * F_, 1, y, n, j0, j1, R_.bf16);
      for (int64_t j = 0; j < n; ++j) acc[j] = R_(acc[j] + R_(R_(y[j]) * weights[s]));
    }
    if (shared_out_.defined()) {  // ungated (Kimi Linear's): g = 1
      const float g = shared_gate_.defined() ? R_(sigmoid(shared_gate_.p[b * shared_gate_.ld])) : 1.0f;
      const float* so = shared_out_.p + b * d_ + j0;
      for (int64_t j = 0; j < n; ++j) acc[j] = R_(acc[j] + R_(g * so[j]));
    }
    float* out = out_.p + b * d_ + j0;
    for (int64_t j = 0; j < n; ++j) out[j] = residual_ ? R_(out[j] + acc[j]) : acc[j];
  }

  Buffer in_;
  NormSpec norm_;
  Buffer logits_, hidden_, out_, shared_gate_, shared_out_;
  int64_t k_, E_ = 0, F_ = 0, d_ = 0;
  bool renorm_, residual_, sigmoid_ = false;
  at::Tensor score_bias_;
  int64_t groups_ = 1, topk_group_ = 1;
  float scaling_ = 1;
  Rounder R_;
  std::vector<Weights> gate_up_, down_;
};

}  // namespace
