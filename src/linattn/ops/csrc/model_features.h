// The feature maps φ of linattn.nn.feature_maps in the fused decoding step (model_mixers.h: the linear
// kind's φ; model_window.h: LoLCATs' φ_q and φ_k), one head's D values at a time, in float with the
// bf16 roundings of the maps whose features the eager path keeps in bf16:
//
//   elu (1)        elu(x) + 1                       favor (3)  FAVOR+ exp(ωx' − ‖x'‖²/2)/√m (stabilized or not)
//   relu (2)       relu(x) (+ ε)                    trig (4)   [sin ωx', cos ωx'] e^{‖x'‖²/2}/√m
//   cosformer (5)  relu(x)·[cos, sin](πi/2L)        taylor (6) [1, x/D^{1/4}, (x ⊗ x)/√(2D)]
//   hedgehog (7)   [softmax(Wx), softmax(−Wx)]
//
// Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "model_ops.h"

namespace {

enum FeatureMapCode { kElu = 1, kReLU = 2, kFavor = 3, kTrig = 4, kCosFormer = 5, kTaylor = 6, kHedgehog = 7 };

// out = softmax(sign · x) over n values, each rounded as the eager softmax's bf16 output is (Hedgehog's
// halves; Liger's softmax features of q and k)
inline void softmax_row(const float* x, float sign, int64_t n, float* out, const Rounder& R) {
  float top = -INFINITY, sum = 0;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, sign * x[i]);
  for (int64_t i = 0; i < n; ++i) sum += std::exp(sign * x[i] - top);
  for (int64_t i = 0; i < n; ++i) out[i] = R(std::exp(sign * x[i] - top) / sum);
}

// One feature map of D-value heads, read from the arguments `prefix`feature_map (its code),
// `prefix`feature_dim (F), `prefix`features_bf16, `prefix`map_eps, `prefix`max_len, `prefix`stabilize and
// the tensor `prefix`projection (FAVOR+ / trig ω, Hedgehog's W: (m, D)) (linattn.nn.feature_maps'
// plan_feature_map)
class FeatureMap {
 public:
  FeatureMap() = default;
  FeatureMap(const Args& a, int64_t D, bool bf16, const std::string& prefix = "")
      : map_(static_cast<int>(a.integer(prefix + "feature_map"))), F_(a.integer(prefix + "feature_dim")), D_(D),
        Rf_{bf16 && a.integer(prefix + "features_bf16") != 0} {
    map_eps_ = static_cast<float>(a.real(prefix + "map_eps", 0.0));
    max_len_ = a.integer(prefix + "max_len", 0);
    stabilize_ = a.integer(prefix + "stabilize", 0) != 0;
    if (a.has(prefix + "projection")) {
      proj_ = a.tensor(prefix + "projection").to(at::kFloat).contiguous();
      m_ = proj_.size(0);
      TORCH_CHECK(proj_.dim() == 2 && proj_.size(1) == D_, "linattn_cpu::DecodePlan: a feature map's projection is (m, D)");
      if (map_ == kFavor) pair_shift();
    }
  }

  int64_t dim() const { return F_; }
  // floats of `work` features() needs
  int64_t work() const { return m_ + D_ + 16; }
  // the features' roundings: bf16 for the maps whose features the eager path keeps in bf16
  const Rounder& rounder() const { return Rf_; }

  void check(const StepInfo& info) const {
    if (map_ != kCosFormer) return;
    for (int64_t b = 0; b < info.batch; ++b) {
      TORCH_CHECK_VALUE(info.pos[b] >= 0 && info.pos[b] < max_len_, "cosFormer positions must lie in [0, max_len=",
                        max_len_, "), got ", info.pos[b]);
    }
  }

  // φ(x) of one head (x: D values) into f (F values), as linattn.feature_maps computes it
  void features(const float* x, bool is_query, int64_t pos, float* f, float* work) const {
    const int64_t D = D_;
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
        softmax_row(work, 1.0f, m, f, R);  // softmax(Wx), then softmax(−Wx)
        softmax_row(work, -1.0f, m, f + m, R);
        break;
      }
      default:
        break;
    }
  }

 private:
  // FAVOR+ / trig: out = ω x' with x' = x·D^{−1/4} (into xs, D values); returns ‖x'‖²/2
  float project(const float* x, float* out, float* xs) const {
    const int64_t D = D_;
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
    const int64_t m = m_, D = D_, p = m / 2;
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

  int map_ = 0;
  int64_t F_ = 0, D_ = 0;
  Rounder Rf_{false};
  float map_eps_ = 0;
  int64_t max_len_ = 0;
  bool stabilize_ = false;
  at::Tensor proj_;
  int64_t m_ = 0;
  std::vector<float> shift_;
  float shift_mean_ = 0;
};

}  // namespace
