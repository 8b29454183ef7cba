// The pieces of the whole-model decoding step (model_step.cpp): the step's shared state, the named
// arguments an op is built from, and the ops that are not attention: the embedding, RoPE tables and
// the groups of matrix-vector products with their norms and epilogues (residual adds, SwiGLU, GELU,
// the gated convolution of conv-mixer blocks).
//
// Every op works on float buffers of B rows (the batch) and runs on all the step's threads at once,
// each taking its share (columns of a product, rows of the batch × heads); the step puts a barrier
// after each op. Values follow the eager path: with a bf16 model each result that eager torch holds
// in a bf16 tensor is rounded to bf16 here too (`Rounder`), so the two paths differ only by the
// order of the float sums. Internal linkage.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "matvec.h"

namespace {

// What every op of one step sees: the batch, the token ids and each row's position (the index of the
// token being decoded), the number of tokens fed so far (the KV caches' write index), the threads.
struct StepInfo {
  int64_t batch;
  const int64_t* ids;
  const int64_t* pos;
  int64_t length;
};

// x, or x rounded to bf16 when the model is bf16 (where the eager path holds a bf16 tensor)
struct Rounder {
  bool bf16;
  float operator()(float x) const { return bf16 ? round_bf16(x) : x; }
};

// One thread's scratch memory: grows to the largest request, then is reused every step
struct Scratch {
  std::vector<float> data;
  float* get(size_t n) {
    if (data.size() < n) data.resize(n);
    return data.data();
  }
};

class Op {
 public:
  virtual ~Op() = default;
  // before the threads start: may raise (a bad token id, a full KV cache, ...)
  virtual void check(const StepInfo&) const {}
  // floats of scratch per thread this op needs
  virtual size_t scratch(const StepInfo&) const { return 0; }
  // before the threads start, for a team of `threads`
  virtual void prepare(int threads) {}
  virtual void run(const StepInfo& info, int tid, int threads, float* scratch) = 0;
  // the weight pass of the weight-streaming measure (matvec groups only)
  virtual void stream(const StepInfo&, int, int, float*) {}
  // a barrier after this op (every op whose results other threads read)
  bool barrier = true;
};

// The named arguments of an op, as the Python builder passes them
struct Args {
  c10::Dict<std::string, at::Tensor> t;
  c10::Dict<std::string, int64_t> i;
  c10::Dict<std::string, double> f;

  bool has(const std::string& name) const { return t.contains(name); }
  at::Tensor tensor(const std::string& name) const {
    TORCH_CHECK(t.contains(name), "linattn_cpu::DecodePlan: missing tensor '", name, "'");
    return t.at(name);
  }
  int64_t integer(const std::string& name) const {
    TORCH_CHECK(i.contains(name), "linattn_cpu::DecodePlan: missing int '", name, "'");
    return i.at(name);
  }
  int64_t integer(const std::string& name, int64_t fallback) const { return i.contains(name) ? i.at(name) : fallback; }
  double real(const std::string& name) const {
    TORCH_CHECK(f.contains(name), "linattn_cpu::DecodePlan: missing float '", name, "'");
    return f.at(name);
  }
  double real(const std::string& name, double fallback) const { return f.contains(name) ? f.at(name) : fallback; }
};

// A float buffer of B rows (an activation the builder allocated), or a small float vector
struct Buffer {
  at::Tensor t;
  float* p = nullptr;
  int64_t ld = 0;
  Buffer() = default;
  explicit Buffer(const at::Tensor& x) : t(x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                "linattn_cpu::DecodePlan: work buffers must be contiguous float32 CPU tensors");
    p = x.data_ptr<float>();
    ld = x.dim() >= 2 ? x.size(-1) : x.numel();
  }
  bool defined() const { return p != nullptr; }
};

inline Buffer buffer(const Args& a, const std::string& name) { return Buffer(a.tensor(name)); }
inline Buffer maybe_buffer(const Args& a, const std::string& name) { return a.has(name) ? Buffer(a.tensor(name)) : Buffer(); }

// A float state tensor of the cache, updated in place
inline float* state_ptr(const Args& a, const std::string& name, int64_t numel) {
  const at::Tensor t = a.tensor(name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              "linattn_cpu::DecodePlan: the state '", name, "' must be a contiguous float32 tensor of ", numel,
              " values");
  return t.data_ptr<float>();
}

// A model tensor read in place (weights, caches): CPU, contiguous, fp32 or bf16
// (its data pointer taken once: at::Tensor::data_ptr checks the dtype and storage on every call, which
// cost more than the arithmetic in the per-channel loops of the short convolution)
struct Held {
  at::Tensor t;
  bool bf16 = false;
  void* p = nullptr;
  Held() = default;
  explicit Held(const at::Tensor& x) : t(x) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                    (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "linattn_cpu::DecodePlan: model tensors must be contiguous float32 or bfloat16 CPU tensors");
    bf16 = x.scalar_type() == at::kBFloat16;
    p = x.data_ptr();
  }
  bool defined() const { return t.defined(); }
  float get(int64_t i) const {
    return bf16 ? static_cast<float>(static_cast<const at::BFloat16*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  void set(int64_t i, float v) const {  // v already holds a value of the tensor's dtype
    if (bf16) {
      static_cast<at::BFloat16*>(p)[i] = static_cast<at::BFloat16>(v);
    } else {
      static_cast<float*>(p)[i] = v;
    }
  }
};

// ----------------------------------------------------------------------------------------------
// elementwise functions, float

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float gelu(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's, beta 1, threshold 20
inline float logsigmoid(float x) { return std::min(x, 0.0f) - std::log1p(std::exp(-std::fabs(x))); }

// ----------------------------------------------------------------------------------------------
// norms

enum NormKind { kNoNorm = 0, kRMSNorm = 1, kLayerNorm = 2 };

// RMSNorm (gain w) or LayerNorm (gain w, bias b) of the n values of x into y, as linattn.layers.RMSNorm
// and nn.LayerNorm compute them: fp32 RMSNorm sums the squares in double (the fused operator of
// decode.cpp); a bf16 model rounds x / rms to bf16 before the gain and the product after it.
// 1 / √(mean(x²) + ε) of the n values of x, as normalize's RMSNorm computes it
inline float rms_inverse(const float* x, int64_t n, float eps, const Rounder& R) {
  if (R.bf16) {
    float ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    return 1.0f / std::sqrt(ss / float(n) + eps);
  }
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  return static_cast<float>(1.0 / std::sqrt(ss / double(n) + eps));
}

// y = x · inv ⊙ w over n values, with RMSNorm's bf16 roundings (inv from rms_inverse, possibly of a
// longer vector x belongs to: the across-heads q/k norm)
inline void rms_scale(const float* x, float* y, int64_t n, float inv, const float* w, const Rounder& R) {
  if (R.bf16) {
    for (int64_t i = 0; i < n; ++i) y[i] = R(R(x[i] * inv) * w[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
  }
}

inline void normalize(int kind, const float* x, float* y, int64_t n, const float* w, const float* b, float eps,
                      const Rounder& R) {
  if (kind == kRMSNorm) {
    rms_scale(x, y, n, rms_inverse(x, n, eps, R), w, R);
  } else if (kind == kLayerNorm) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i) mean += x[i];
    mean /= double(n);
    for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    const float m = float(mean), rstd = static_cast<float>(1.0 / std::sqrt(var / double(n) + eps));
    for (int64_t i = 0; i < n; ++i) y[i] = R((x[i] - m) * rstd * w[i] + (b != nullptr ? b[i] : 0.0f));
  } else {
    std::copy(x, x + n, y);
  }
}

struct NormSpec {
  int kind = kNoNorm;
  at::Tensor w, b;  // float copies of the gain and bias
  float eps = 0;

  static NormSpec from(const Args& a, const std::string& prefix) {
    NormSpec s;
    s.kind = static_cast<int>(a.integer(prefix + "_kind", kNoNorm));
    if (s.kind != kNoNorm) {
      s.w = a.tensor(prefix + "_weight").to(at::kFloat).contiguous();
      if (a.has(prefix + "_bias")) s.b = a.tensor(prefix + "_bias").to(at::kFloat).contiguous();
      s.eps = static_cast<float>(a.real(prefix + "_eps"));
    }
    return s;
  }
  void apply(const float* x, float* y, int64_t n, const Rounder& R) const {
    normalize(kind, x, y, n, kind == kNoNorm ? nullptr : w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
              eps, R);
  }
};

// x ← x + Norm(in) row by row: a post-norm block's residual (OLMo2's, OLMo-Hybrid's order, x ← x +
// Norm(f(x)); linattn.nn.blocks.Block with post_norm), the rows shared among the threads
class ResidualNormOp : public Op {
 public:
  ResidualNormOp(const Args& a, bool bf16)
      : in_(buffer(a, "input")), x_(buffer(a, "x")), norm_(NormSpec::from(a, "norm")), R_{bf16} {
    TORCH_CHECK(in_.ld == x_.ld && norm_.kind != kNoNorm,
                "linattn_cpu::DecodePlan: norm_add needs a norm of x's width");
  }
  size_t scratch(const StepInfo&) const override { return static_cast<size_t>(x_.ld); }
  void run(const StepInfo& info, int tid, int threads, float* scratch) override {
    const int64_t d = x_.ld;
    for (int64_t b = info.batch * tid / threads; b < info.batch * (tid + 1) / threads; ++b) {
      norm_.apply(in_.p + b * d, scratch, d, R_);
      float* x = x_.p + b * d;
      for (int64_t i = 0; i < d; ++i) x[i] = R_(x[i] + scratch[i]);
    }
  }

 private:
  Buffer in_, x_;
  NormSpec norm_;
  Rounder R_;
};

// ----------------------------------------------------------------------------------------------
// RoPE tables: c = [cos, cos, (1)], s = [−sin, sin, (0)] of position·θ_m, θ_m = base^(−m/P), P = ⌊dim/2⌋,
// per batch row, as linattn.positional.RotaryEmbedding.angles builds them (float angles from float64
// frequencies), rounded to bf16 when they rotate bf16 tensors.

class RopeTableOp : public Op {
 public:
  explicit RopeTableOp(const Args& a)
      : c_(buffer(a, "cos")), s_(buffer(a, "sin")), dim_(a.integer("dim")), R_{a.integer("bf16") != 0} {
    const int64_t half = dim_ / 2;
    const double base = a.real("base");
    freq_.resize(half);
    for (int64_t m = 0; m < half; ++m) freq_[m] = static_cast<float>(std::pow(base, -double(m) / double(half)));
    barrier = false;  // run by thread 0 before the embedding, which the first barrier follows
  }
  void run(const StepInfo& info, int tid, int, float*) override {
    if (tid != 0) return;
    const int64_t half = dim_ / 2;
    for (int64_t b = 0; b < info.batch; ++b) {
      float* c = c_.p + b * c_.ld;
      float* s = s_.p + b * s_.ld;
      const float p = static_cast<float>(info.pos[b]);
      for (int64_t m = 0; m < half; ++m) {
        const float ang = p * freq_[m];
        const float cm = R_(std::cos(ang)), sm = R_(std::sin(ang));
        c[m] = c[m + half] = cm;
        s[m] = -sm;
        s[m + half] = sm;
      }
      if (dim_ % 2 == 1) {
        c[dim_ - 1] = 1.0f;
        s[dim_ - 1] = 0.0f;
      }
    }
  }

 private:
  Buffer c_, s_;
  int64_t dim_;
  Rounder R_;
  std::vector<float> freq_;
};

// x·c + swap(x)·s over the n values of x (swap exchanges the halves [0, P) and [P, 2P); an odd n's last
// value stays), each product with c rounded as the eager path rounds it
inline void rotate(const float* x, const float* c, const float* s, float* y, int64_t n, const Rounder& R) {
  const int64_t half = n / 2;
  for (int64_t f = 0; f < n; ++f) {
    const int64_t g = f < half ? f + half : (f < 2 * half ? f - half : f);
    y[f] = R(R(x[f] * c[f]) + x[g] * s[f]);
  }
}

// ----------------------------------------------------------------------------------------------
// token (+ position) embedding: x_b = E[id_b] (+ P[pos_b])

class EmbedOp : public Op {
 public:
  explicit EmbedOp(const Args& a) : table_(a.tensor("table")), x_(buffer(a, "x")), R_{a.integer("bf16") != 0} {
    if (a.has("positions")) pos_table_ = Held(a.tensor("positions"));
    TORCH_CHECK(table_.t.dim() == 2 && table_.t.size(1) == x_.ld, "linattn_cpu::DecodePlan: embedding of the wrong width");
  }
  void check(const StepInfo& info) const override {
    const int64_t V = table_.t.size(0);
    for (int64_t b = 0; b < info.batch; ++b) {
      TORCH_CHECK_VALUE(info.ids[b] >= 0 && info.ids[b] < V, "ids must be token ids in [0, vocab_size=", V, "), got ",
                        info.ids[b], " at row ", b);
      if (pos_table_.defined()) {
        TORCH_CHECK_VALUE(info.pos[b] < pos_table_.t.size(0), "position ", info.pos[b], " is beyond max_len=",
                          pos_table_.t.size(0));
      }
    }
  }
  void run(const StepInfo& info, int tid, int, float*) override {
    if (tid != 0) return;
    const int64_t d = x_.ld;
    for (int64_t b = 0; b < info.batch; ++b) {
      float* x = x_.p + b * d;
      for (int64_t i = 0; i < d; ++i) x[i] = table_.get(info.ids[b] * d + i);
      if (pos_table_.defined()) {
        for (int64_t i = 0; i < d; ++i) x[i] = R_(x[i] + pos_table_.get(info.pos[b] * d + i));
      }
    }
  }

 private:
  Held table_, pos_table_;
  Buffer x_;
  Rounder R_;
};

// ----------------------------------------------------------------------------------------------
// a group of products of one input (optionally normalized first, by every thread for itself)

enum Epilogue {
  kStore = 0,      // out = y + bias
  kResidual = 1,   // out = out + (y + bias)
  kSwiGLU = 2,     // weight columns [gate | up]: out = silu(gate) · up
  kGELU = 3,       // out = gelu(y + bias)
  kGatedConv = 4,  // out = out + (u + conv(u) · (y + bias)), u the (normalized) input: Zoology's BaseConv
  kFloat = 5,      // out = y + bias, not rounded (a float32 product of a bf16 model: the sigmoid router's)
};

struct Product {
  Weights w;            // fp32, bf16 or int8 with scales (matvec.h)
  bool kn = true;       // w is Wt (K × N); else W (N × K)
  int64_t K = 0, N = 0;  // N: the product's columns (both halves for SwiGLU)
  at::Tensor bias;      // float (N) or undefined
  const float* bias_p = nullptr;
  int epilogue = kStore;
  at::Tensor out;       // (B, width) float32, or the model dtype for the logits
  int64_t width = 0;    // columns written: N, or N / 2 for SwiGLU
  // kGatedConv: the convolution's weights (width, taps) and bias as floats, its tail (B, taps − 1, width)
  at::Tensor conv_w, conv_b;
  Held tail;
  int64_t taps = 0;
};

struct Task {
  int product;
  int64_t j0, j1;  // output columns (of `width`)
};

class MatvecGroupOp : public Op {
 public:
  explicit MatvecGroupOp(const Args& a, bool bf16)
      : in_(buffer(a, "input")), norm_(NormSpec::from(a, "norm")), R_{bf16} {}

  void add(const Args& a) {
    Product p;
    p.kn = a.integer("kn") != 0;
    p.w = Weights(a.tensor("weight"), p.kn, a.has("scale") ? a.tensor("scale") : at::Tensor());
    p.w.quantize_activations_too(static_cast<int>(a.integer("act_quant", 0)));
    p.K = p.w.K;
    p.N = p.w.N;
    TORCH_CHECK(p.K == in_.ld, "linattn_cpu::DecodePlan: a weight takes ", p.K, " inputs, the buffer has ", in_.ld);
    if (a.has("bias")) {
      p.bias = a.tensor("bias").to(at::kFloat).contiguous();
      p.bias_p = p.bias.data_ptr<float>();
    }
    p.epilogue = static_cast<int>(a.integer("epilogue"));
    p.out = a.tensor("out");
    TORCH_CHECK(p.out.is_contiguous() && (p.out.scalar_type() == at::kFloat ||
                                          (p.epilogue == kStore && p.out.scalar_type() == at::kBFloat16)),
                "linattn_cpu::DecodePlan: bad output buffer");
    p.width = p.epilogue == kSwiGLU ? p.N / 2 : p.N;
    TORCH_CHECK(p.out.size(-1) == p.width, "linattn_cpu::DecodePlan: output buffer of the wrong width");
    if (p.epilogue == kGatedConv) {
      p.conv_w = a.tensor("conv_weight").to(at::kFloat).contiguous();
      p.conv_b = a.tensor("conv_bias").to(at::kFloat).contiguous();
      p.taps = p.conv_w.size(1);
      p.tail = Held(a.tensor("tail"));
      TORCH_CHECK(p.K == p.N && p.conv_w.size(0) == p.N, "linattn_cpu::DecodePlan: the gated convolution is square");
    }
    if (p.out.data_ptr() == in_.t.data_ptr()) {  // a conv-mixer block's x += GatedConv(norm(x))
      TORCH_CHECK(norm_.kind != kNoNorm, "linattn_cpu::DecodePlan: a product writing its own input needs a norm");
      writes_input_ = true;
    }
    products_.push_back(std::move(p));
  }

  size_t scratch(const StepInfo& info) const override {
    int64_t cols = 0;
    for (const Product& p : products_) cols = std::max(cols, p.N);
    return static_cast<size_t>(info.batch * (in_.ld + cols + 16));
  }

  void run(const StepInfo& info, int tid, int threads, float* scratch) override {
    const std::vector<Task>& tasks = plans_[threads][tid];
    // a group writing its own input waits until every thread has read it (threads share the plan's
    // barriers: all of them meet this one, tasks or not)
    const bool wait = writes_input_ && threads > 1;
    if (tasks.empty()) {
#ifdef _OPENMP
      if (wait) {
#pragma omp barrier
      }
#endif
      return;
    }
    const int64_t B = info.batch, K = in_.ld;
    const float* x = in_.p;
    float* y = scratch;
    if (norm_.kind != kNoNorm) {  // each thread normalizes the whole input for itself
      float* xn = scratch;
      for (int64_t b = 0; b < B; ++b) norm_.apply(in_.p + b * K, xn + b * K, K, R_);
      x = xn;
      y = scratch + B * K;
    }
#ifdef _OPENMP
    if (wait) {
#pragma omp barrier
    }
#endif
    for (const Task& task : tasks) {
      const Product& p = products_[task.product];
      const int64_t n = task.j1 - task.j0;
      if (p.epilogue == kSwiGLU) {  // the gate's columns, then the same columns of the up half
        product(p, x, B, y, 2 * n, task.j0, task.j1);
        product(p, x, B, y + n, 2 * n, p.width + task.j0, p.width + task.j1);
        swiglu(p, y, B, task.j0, n);
      } else {
        product(p, x, B, y, n, task.j0, task.j1);
        finish(p, x, y, B, task.j0, n);
      }
    }
  }

  void stream(const StepInfo& info, int tid, int threads, float* scratch) override {
    for (const Task& task : plans_[threads][tid]) {
      const Product& p = products_[task.product];
      const int64_t n = task.j1 - task.j0;
      product(p, in_.p, info.batch, scratch, p.epilogue == kSwiGLU ? 2 * n : n, task.j0, task.j1);
      if (p.epilogue == kSwiGLU) product(p, in_.p, info.batch, scratch + n, 2 * n, p.width + task.j0, p.width + task.j1);
    }
  }

  // every weight with its layout, for the weight-streaming measure
  const std::vector<Product>& products() const { return products_; }

 private:
  void product(const Product& p, const float* x, int64_t B, float* y, int64_t ldy, int64_t j0, int64_t j1) const {
    matvec(p.w, x, B, y, ldy, j0, j1, R_.bf16);
  }

  float biased(const Product& p, float y, int64_t j) const { return R_(p.bias_p != nullptr ? y + p.bias_p[j] : y); }

  void swiglu(const Product& p, const float* y, int64_t B, int64_t j0, int64_t n) const {
    float* out = p.out.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < n; ++j) {
        const float gate = biased(p, y[b * 2 * n + j], j0 + j), up = biased(p, y[b * 2 * n + n + j], p.width + j0 + j);
        out[b * p.width + j0 + j] = R_(R_(silu(gate)) * up);
      }
    }
  }

  void finish(const Product& p, const float* x, const float* y, int64_t B, int64_t j0, int64_t n) const {
    if (p.out.scalar_type() == at::kBFloat16) {
      at::BFloat16* out = p.out.data_ptr<at::BFloat16>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < n; ++j) out[b * p.width + j0 + j] = static_cast<at::BFloat16>(biased(p, y[b * n + j], j0 + j));
      return;
    }
    float* out = p.out.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float* o = out + b * p.width + j0;
      const float* yb = y + b * n;
      switch (p.epilogue) {
        case kStore:
          for (int64_t j = 0; j < n; ++j) o[j] = biased(p, yb[j], j0 + j);
          break;
        case kFloat:
          for (int64_t j = 0; j < n; ++j) o[j] = p.bias_p != nullptr ? yb[j] + p.bias_p[j0 + j] : yb[j];
          break;
        case kResidual:
          for (int64_t j = 0; j < n; ++j) o[j] = R_(o[j] + biased(p, yb[j], j0 + j));
          break;
        case kGELU:
          for (int64_t j = 0; j < n; ++j) o[j] = R_(gelu(biased(p, yb[j], j0 + j)));
          break;
        case kGatedConv:
          gated_conv(p, x + b * p.K, yb, o, b, j0, n);
          break;
        default:
          break;
      }
    }
  }

  // out_j += u_j + conv(u)_j · (y_j + bias_j) for the n channels from j0 of batch row b; the tail (the
  // last taps − 1 inputs, linattn.convolution.ShortConvolution's cache) moves on by one token
  void gated_conv(const Product& p, const float* u, const float* y, float* out, int64_t b, int64_t j0, int64_t n) const {
    const int64_t C = p.width, T = p.taps;
    const float* w = p.conv_w.data_ptr<float>();
    const float* cb = p.conv_b.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j) {
      const int64_t c = j0 + j;
      const float conv = short_conv(p.tail, b, c, C, T, u[c], w + c * T, cb[c], R_);
      out[j] = R_(out[j] + R_(u[c] + conv * biased(p, y[j], c)));
    }
  }

 public:
  // one channel of a causal depthwise convolution at the new token x (linattn.convolution: Σ_j w_j ·
  // [tail; x]_j, rounded after every term as the eager path's multiply-adds are), tail moved on
  static float short_conv(const Held& tail, int64_t b, int64_t c, int64_t C, int64_t T, float x, const float* w,
                          float bias, const Rounder& R, bool has_bias = true) {
    const int64_t base = b * (T - 1) * C + c;
    float acc = 0;
    for (int64_t m = 0; m < T; ++m) {
      const float xm = m + 1 < T ? tail.get(base + m * C) : x;
      acc = m == 0 ? R(xm * w[0]) : R(acc + xm * w[m]);
    }
    if (has_bias) acc = R(acc + bias);
    for (int64_t m = 0; m + 2 < T; ++m) tail.set(base + m * C, tail.get(base + (m + 1) * C));
    if (T > 1) tail.set(base + (T - 2) * C, x);
    return acc;
  }

 private:
  // tasks per thread: products of fewer than 2^15 weights go whole to the least loaded thread, larger
  // ones are split into equal column ranges (multiples of 16)
  void prepare(int threads) override {
    if (static_cast<int>(plans_.size()) <= threads) plans_.resize(threads + 1);
    std::vector<std::vector<Task>>& plan = plans_[threads];
    if (!plan.empty()) return;
    plan.assign(threads, {});
    std::vector<int64_t> load(threads, 0);
    for (int i = 0; i < static_cast<int>(products_.size()); ++i) {
      const Product& p = products_[i];
      const int64_t work = p.K * p.N;
      if (threads == 1 || work < (int64_t{1} << 15)) {
        const int t = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
        plan[t].push_back({i, 0, p.width});
        load[t] += work;
        continue;
      }
      const int64_t units = (p.width + 15) / 16;
      for (int t = 0; t < threads; ++t) {
        const int64_t j0 = std::min(p.width, units * t / threads * 16), j1 = std::min(p.width, units * (t + 1) / threads * 16);
        if (j1 > j0) plan[t].push_back({i, j0, j1});
        load[t] += work * (j1 - j0) / std::max<int64_t>(1, p.width);
      }
    }
  }

 private:
  Buffer in_;
  NormSpec norm_;
  Rounder R_;
  std::vector<Product> products_;
  bool writes_input_ = false;
  std::vector<std::vector<std::vector<Task>>> plans_;  // [team size][thread] -> tasks
};

}  // namespace
