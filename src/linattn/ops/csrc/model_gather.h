// The gather op of the whole-model decoding step (model_step.cpp): columns of some buffers copied into
// one, row by row,
//
//   out[b, j] = [in₀ | in₁ | … ][b, index[j]]       (in_i (B, C_i) side by side, index (W,) into them)
//
// Multi-head latent attention's projections (linattn.nn.mla.LatentQKV) use it to lay out q, the
// per-head k and v of W_kvb's output and the key features shared by the heads as a fused q|k|v
// projection's [q | k | v], and to take the latent out of W_kva's output. A copy: values stay as
// they are (already rounded as the eager path holds them). Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "model_ops.h"

namespace {

class GatherOp : public Op {
 public:
  explicit GatherOp(const Args& a) : out_(buffer(a, "out")) {
    const int64_t n = a.integer("inputs");
    int64_t width = 0;
    for (int64_t i = 0; i < n; ++i) {
      in_.push_back(buffer(a, "input" + std::to_string(i)));
      width += in_.back().ld;
    }
    const at::Tensor index = a.tensor("index").to(at::kLong).contiguous();
    TORCH_CHECK(index.numel() == out_.ld, "linattn_cpu::DecodePlan: gather needs one index per output column");
    const int64_t* p = index.data_ptr<int64_t>();
    for (int64_t j = 0; j < out_.ld; ++j) {  // index → (input, column)
      TORCH_CHECK(p[j] >= 0 && p[j] < width, "linattn_cpu::DecodePlan: gather index out of range");
      int64_t i = 0, c = p[j];
      while (c >= in_[i].ld) c -= in_[i++].ld;
      source_.push_back(i);
      column_.push_back(c);
    }
  }

  void run(const StepInfo& info, int tid, int threads, float*) override {
    for (int64_t b = info.batch * tid / threads; b < info.batch * (tid + 1) / threads; ++b) {
      float* out = out_.p + b * out_.ld;
      for (int64_t j = 0; j < out_.ld; ++j) out[j] = in_[source_[j]].p[b * in_[source_[j]].ld + column_[j]];
    }
  }

 private:
  Buffer out_;
  std::vector<Buffer> in_;
  std::vector<int64_t> source_, column_;
};

}  // namespace
