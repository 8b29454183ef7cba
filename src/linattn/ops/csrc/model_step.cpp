// One decoding step of a whole model in one call (linattn.decoding): `linattn_cpu.DecodePlan`, a
// TorchScript class built once per decoding run from the model's layers (the Python builder adds the
// ops in order), then called once per token.
//
//   ids (B,) -> embedding (+ positions) -> per block: [norm → q|k|v (+ gate, β, decay) products] →
//   attention per (row, head) on the cached state → [output product + residual] → [norm → FFN up,
//   SwiGLU / GELU] → [FFN down + residual] (conv-mixer blocks: [norm → gated convolution + residual]
//   before the attention) -> final norm -> LM head -> logits (B, V)
//
// No tensor is allocated per token: the activations live in buffers made once, the states, convolution
// tails and KV caches of the model's cache are updated in place, and the products read the weights in
// place (fp32, bf16, or int8 with per-column scales; widened in registers: model_ops.h, matvec.h).
// All ops run inside one parallel region with a barrier after each (about five per layer), each
// thread taking its share of every op: columns of the products, (batch row, head) pairs of the
// attention. The same ops run by `stream()` without their norms, epilogues and attention give the
// time to read every weight once, the bound a decoding step at small batch cannot beat.
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "model_gather.h"
#include "model_mixers.h"
#include "model_moe.h"
#include "model_ops.h"
#include "model_window.h"

namespace {

// The mixers by name: the plan's op of that name (linattn.models.kinds.FUSED_MIXERS, a kind's `fused`)
// is built by this table. A new fused mixer is its class (model_mixers.h, or a header of its own such as
// model_window.h) and one entry here.

using MixerFactory = std::unique_ptr<Op> (*)(const Args&, bool bf16);

template <class Mixer>
std::unique_ptr<Op> make_mixer(const Args& a, bool bf16) {
  return std::make_unique<Mixer>(a, bf16);
}

const std::map<std::string, MixerFactory>& mixer_table() {
  static const std::map<std::string, MixerFactory> table = {
      {"linear", make_mixer<LinearMixOp>},
      {"gated", make_mixer<GatedMixOp>},
      {"delta", make_mixer<DeltaMixOp>},
      {"softmax", make_mixer<SoftmaxMixOp>},
      {"window", make_mixer<WindowMixOp>},
  };
  return table;
}

class DecodePlan : public torch::CustomClassHolder {
 public:
  // The plan holds no position of its own: each step is given the positions of the tokens it decodes
  // and the tokens fed so far, which the caller's cache counts (linattn.models.decoding).
  DecodePlan(int64_t batch, bool bf16) : batch_(batch), bf16_(bf16) {
    TORCH_CHECK(batch > 0, "linattn_cpu::DecodePlan: batch must be positive");
  }

  // Appends an op: kind "rope", "embed", "group" (a new group of products of one input), "product"
  // (one more product of the last group), "norm_add" (x += Norm(input): post-norm blocks), "moe"
  // (model_moe.h), "gather" (columns of buffers into one, model_gather.h), or a mixer of
  // `mixer_table()` (above: "linear", "gated", "delta", "softmax", "window"), with its named tensors,
  // ints and floats (see linattn.models.decoding).
  void add(const std::string& kind, c10::Dict<std::string, at::Tensor> t, c10::Dict<std::string, int64_t> i,
           c10::Dict<std::string, double> f) {
    Args a{std::move(t), std::move(i), std::move(f)};
    a.i.insert_or_assign("batch", batch_);
    if (kind == "product") {
      TORCH_CHECK(group_ != nullptr, "linattn_cpu::DecodePlan: a product needs a group first");
      group_->add(a);
      return;
    }
    group_ = nullptr;
    if (kind == "group") {
      auto g = std::make_unique<MatvecGroupOp>(a, bf16_);
      group_ = g.get();
      ops_.push_back(std::move(g));
    } else if (kind == "rope") {
      ops_.push_back(std::make_unique<RopeTableOp>(a));
    } else if (kind == "embed") {
      ops_.push_back(std::make_unique<EmbedOp>(a));
    } else if (kind == "norm_add") {
      ops_.push_back(std::make_unique<ResidualNormOp>(a, bf16_));
    } else if (kind == "moe") {
      ops_.push_back(std::make_unique<MoEOp>(a, bf16_));
    } else if (kind == "gather") {
      ops_.push_back(std::make_unique<GatherOp>(a));
    } else {
      const auto& mixers = mixer_table();
      const auto found = mixers.find(kind);
      TORCH_CHECK(found != mixers.end(), "linattn_cpu::DecodePlan: unknown op '", kind, "'");
      ops_.push_back(found->second(a, bf16_));
    }
  }

  // The names of the fused mixers (`mixer_table()`)
  static std::vector<std::string> mixers() {
    std::vector<std::string> names;
    for (const auto& entry : mixer_table()) names.push_back(entry.first);
    return names;
  }

  // One token per row: ids (B,) int64, positions (B,) int64 (each row's position of its token),
  // length: the tokens fed so far (pads included; the KV caches' write index). Writes the logits
  // buffer of the last group and advances the caches' tensors in place; the positions are the caller's.
  void step(const at::Tensor& ids, const at::Tensor& positions, int64_t length) {
    TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.numel() == batch_,
                "linattn_cpu::DecodePlan: ids must be a contiguous (B,) int64 tensor");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == batch_,
                "linattn_cpu::DecodePlan: positions must be a contiguous (B,) int64 tensor");
    TORCH_CHECK(length >= 0, "linattn_cpu::DecodePlan: length must be >= 0");
    execute(StepInfo{batch_, ids.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), length}, false);
  }

  // Every product of the plan once (same threads and column shares as a step), nothing else
  void stream() { execute(StepInfo{batch_, nullptr, nullptr, 0}, true); }

  // Bytes of the weights the products read (int8 weights: and their scales)
  int64_t weight_bytes() const {
    int64_t total = 0;
    for (const auto& op : ops_) {
      if (const auto* g = dynamic_cast<const MatvecGroupOp*>(op.get())) {
        for (const Product& p : g->products()) total += p.w.bytes();
      }
    }
    return total;
  }

 private:
  void execute(const StepInfo& info, bool weights_only) {
    size_t need = 16;
    for (const auto& op : ops_) {
      if (!weights_only) op->check(info);
      need = std::max(need, op->scratch(info));
    }
    int threads = 1;
#ifdef _OPENMP
    if (!at::in_parallel_region()) threads = std::max(1, at::get_num_threads());
#endif
    for (const auto& op : ops_) {
      op->prepare(threads);
      op->prepare(1);
    }
    if (static_cast<int>(scratch_.size()) < threads) scratch_.resize(threads);
    for (int t = 0; t < threads; ++t) scratch_[t].get(need);
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      if (team == threads) {
        run_ops(info, tid, team, scratch_[tid].data.data(), weights_only);
      } else if (tid == 0) {  // fewer threads than asked for: thread 0 alone
        run_ops(info, 0, 1, scratch_[0].data.data(), weights_only);
      }
    }
#else
    run_ops(info, 0, 1, scratch_[0].data.data(), weights_only);
#endif
  }

  // every op in order on thread `tid` of `team`; the barriers are met by all threads alike
  void run_ops(const StepInfo& info, int tid, int team, float* scratch, bool weights_only) {
    for (const auto& op : ops_) {
      if (weights_only) {
        op->stream(info, tid, team, scratch);
        continue;
      }
      op->run(info, tid, team, scratch);
#ifdef _OPENMP
      if (op->barrier && team > 1) {
#pragma omp barrier
      }
#endif
    }
  }

  int64_t batch_;
  bool bf16_;
  std::vector<std::unique_ptr<Op>> ops_;
  MatvecGroupOp* group_ = nullptr;
  std::vector<Scratch> scratch_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<int64_t, bool>())
      .def_static("mixers", &DecodePlan::mixers)
      .def("add", &DecodePlan::add)
      .def("step", &DecodePlan::step)
      .def("stream", &DecodePlan::stream)
      .def("weight_bytes", &DecodePlan::weight_bytes);
}
