// The short causal depthwise convolution of linattn.nn.convolution (design §14.1) in one pass each way,
// without the padded copy [tail; x] the torch ops build. With xp = [tail; x] (B, K−1+N, C), tail zeros
// when absent,
//
//   y[b, t, c]   = Σ_j w[c, j] · xp[b, t + j, c]                      (t < N; j < K; a product, then K − 1 adds)
//   ∂xp[b, s, c] = Σ_j w[c, j] · ∂y[b, s − j, c]   over 0 ≤ s − j < N  (∂x = ∂xp[K−1:], ∂tail = ∂xp[:K−1])
//   ∂w[c, j]     = Σ_{b, t} ∂y[b, t, c] · xp[b, t + j, c]
//
// Packed sequences (cu_seqlens, x (1, T, C)) keep apart: each reads its own tail (or zeros) before its
// first row. Each output is the same K products summed in the same order (y ← xp_t·w_0, then y ← y +
// xp_{t+j}·w_j) whatever N and however the sequences are laid out, so a prefill and token-by-token
// steps (N = 1 with the tail), and packed and separate calls, give the same bits. The channel loop is
// the vectorized one. ∂w sums over rows in per-thread partial sums, added in a fixed order.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "common.h"

namespace {

// The sequences of a call: x (R rows of C) holds S sequences end to end, sequence q at rows
// [start[q], start[q + 1]); its tail is rows q·(K − 1) … of `tail` (nullptr: zeros). Unpacked
// x (B, N, C) is B sequences of N rows; packed, the cu_seqlens of one row.
struct Sequences {
  std::vector<int64_t> start;  // S + 1 offsets
  std::vector<int64_t> seq;    // the sequence of each row
  Sequences(int64_t B, int64_t N) : start(B + 1), seq(B * N) {
    for (int64_t q = 0; q <= B; ++q) start[q] = q * N;
    for (int64_t r = 0; r < B * N; ++r) seq[r] = r / N;
  }
  explicit Sequences(const at::Tensor& cu) {
    const at::Tensor c = cu.to(at::kLong).contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    start.assign(p, p + c.numel());
    seq.resize(start.back());
    for (size_t q = 0; q + 1 < start.size(); ++q)
      for (int64_t r = start[q]; r < start[q + 1]; ++r) seq[r] = static_cast<int64_t>(q);
  }
  int64_t count() const { return static_cast<int64_t>(start.size()) - 1; }
};

// row e of sequence q's [tail; x] (e < K − 1: its tail's, nullptr without one: zeros)
template <typename T>
inline const T* extended_row(const T* x, const T* tail, const Sequences& sq, int64_t q, int64_t e, int64_t K,
                             int64_t C) {
  if (e >= K - 1) return x + (sq.start[q] + e - (K - 1)) * C;
  return tail == nullptr ? nullptr : tail + (q * (K - 1) + e) * C;
}

template <typename T>
LINATTN_CLONES void conv_rows(const T* __restrict__ x, const T* __restrict__ tail, const T* __restrict__ wt,
                              T* __restrict__ y, const Sequences& sq, int64_t r0, int64_t r1, int64_t K, int64_t C) {
  // wt (K, C): w transposed, so that a tap is a contiguous channel vector
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t q = sq.seq[r], t = r - sq.start[q];
    T* __restrict__ yt = y + r * C;
    const T* x0 = extended_row(x, tail, sq, q, t, K, C);
    if (x0 == nullptr) {
      for (int64_t c = 0; c < C; ++c) yt[c] = T(0) * wt[c];
    } else {
      for (int64_t c = 0; c < C; ++c) yt[c] = x0[c] * wt[c];
    }
    for (int64_t j = 1; j < K; ++j) {
      const T* xj = extended_row(x, tail, sq, q, t + j, K, C);
      const T* __restrict__ wj = wt + j * C;
      if (xj == nullptr) {
        for (int64_t c = 0; c < C; ++c) yt[c] = yt[c] + T(0) * wj[c];
      } else {
        for (int64_t c = 0; c < C; ++c) yt[c] = yt[c] + xj[c] * wj[c];
      }
    }
  }
}

Sequences sequences_of(const at::Tensor& x, const c10::optional<at::Tensor>& cu_seqlens) {
  if (!cu_seqlens.has_value()) return Sequences(x.size(0), x.size(1));
  TORCH_CHECK(x.size(0) == 1, "linattn_cpu::short_conv: packed sequences come in one row");
  Sequences sq(*cu_seqlens);
  TORCH_CHECK(sq.start.size() >= 2 && sq.start.front() == 0 && sq.start.back() == x.size(1),
              "linattn_cpu::short_conv: cu_seqlens must run from 0 to the row's length");
  return sq;
}

void check(const at::Tensor& x, const c10::optional<at::Tensor>& tail, const at::Tensor& w, int64_t sequences) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 2 && w.size(0) == x.size(2) && w.size(1) >= 1,
              "linattn_cpu::short_conv expects x (B, N, C) and w (C, K)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "linattn_cpu::short_conv takes float32 or float64 x and w of one dtype");
  if (tail.has_value()) {
    TORCH_CHECK(tail->dim() == 3 && tail->size(0) == sequences && tail->size(1) == w.size(1) - 1 &&
                    tail->size(2) == x.size(2) && tail->scalar_type() == x.scalar_type(),
                "linattn_cpu::short_conv: tail must be (sequences, K − 1, C) in x's dtype");
  }
}

// y (B, N, C) of x (B, N, C), the tails (sequences, K − 1, C) or None (zeros) and w (C, K); cu_seqlens:
// x (1, T, C) holds packed sequences
at::Tensor short_conv(const at::Tensor& x_in, const c10::optional<at::Tensor>& tail_in, const at::Tensor& w_in,
                      const c10::optional<at::Tensor>& cu_seqlens) {
  const Sequences sq = sequences_of(x_in, cu_seqlens);
  check(x_in, tail_in, w_in, sq.count());
  const at::Tensor x = x_in.contiguous(), wt = w_in.t().contiguous();
  const at::Tensor tail = tail_in.has_value() && w_in.size(1) > 1 ? tail_in->contiguous() : at::Tensor();
  const int64_t R = x.size(0) * x.size(1), C = x.size(2), K = w_in.size(1);
  at::Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "linattn_cpu_short_conv", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pw = wt.data_ptr<scalar_t>();
    const scalar_t* pt = tail.defined() ? tail.data_ptr<scalar_t>() : nullptr;
    scalar_t* py = y.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, C * K));
    at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) { conv_rows<scalar_t>(px, pt, pw, py, sq, r0, r1, K, C); });
  });
  return y;
}

// (∂x, ∂tail or undefined, ∂w (C, K)) from ∂y (B, N, C)
std::tuple<at::Tensor, at::Tensor, at::Tensor> short_conv_backward(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                                   const c10::optional<at::Tensor>& tail_in,
                                                                   const at::Tensor& w_in,
                                                                   const c10::optional<at::Tensor>& cu_seqlens) {
  const Sequences sq = sequences_of(x_in, cu_seqlens);
  check(x_in, tail_in, w_in, sq.count());
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "linattn_cpu::short_conv_backward: dy must be shaped and typed like x");
  const at::Tensor x = x_in.contiguous(), dy = dy_in.contiguous(), wt = w_in.t().contiguous();
  const bool has_tail = tail_in.has_value() && w_in.size(1) > 1;
  const at::Tensor tail = has_tail ? tail_in->contiguous() : at::Tensor();
  const int64_t S = sq.count(), C = x.size(2), K = w_in.size(1);
  at::Tensor dx = at::empty_like(x);
  at::Tensor dtail = has_tail ? at::empty_like(tail) : at::Tensor();
  at::Tensor dwt = at::zeros({K, C}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "linattn_cpu_short_conv_backward", [&] {
    const scalar_t *px = x.data_ptr<scalar_t>(), *pdy = dy.data_ptr<scalar_t>(), *pw = wt.data_ptr<scalar_t>();
    const scalar_t* pt = has_tail ? tail.data_ptr<scalar_t>() : nullptr;
    scalar_t* pdx = dx.data_ptr<scalar_t>();
    scalar_t* pdt = has_tail ? dtail.data_ptr<scalar_t>() : nullptr;
    const int threads = at::get_num_threads();
    std::vector<scalar_t> partial(static_cast<size_t>(threads) * K * C, scalar_t(0));
    // per sequence q of L rows, its extended rows e in [0, K − 1 + L): ∂xp[e] = Σ_j w_j ∂y[e − j] over
    // 0 ≤ e − j < L, and ∂w_j += ∂y_t ⊙ xp[t + j]
    at::parallel_for(0, S, 1, [&](int64_t q0, int64_t q1) {
      scalar_t* __restrict__ dw = partial.data() + static_cast<size_t>(at::get_thread_num()) * K * C;
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t s0 = sq.start[q], L = sq.start[q + 1] - s0;
        for (int64_t e = has_tail ? 0 : K - 1; e < K - 1 + L; ++e) {
          scalar_t* __restrict__ out = e >= K - 1 ? pdx + (s0 + e - (K - 1)) * C : pdt + (q * (K - 1) + e) * C;
          for (int64_t c = 0; c < C; ++c) out[c] = scalar_t(0);
          for (int64_t j = 0; j < K; ++j) {
            const int64_t t = e - j;
            if (t < 0 || t >= L) continue;
            const scalar_t* __restrict__ g = pdy + (s0 + t) * C;
            const scalar_t* __restrict__ wj = pw + j * C;
            for (int64_t c = 0; c < C; ++c) out[c] += wj[c] * g[c];
          }
        }
        for (int64_t t = 0; t < L; ++t) {
          const scalar_t* __restrict__ g = pdy + (s0 + t) * C;
          for (int64_t j = 0; j < K; ++j) {
            const scalar_t* r = extended_row(px, pt, sq, q, t + j, K, C);
            if (r == nullptr) continue;
            scalar_t* __restrict__ dwj = dw + j * C;
            for (int64_t c = 0; c < C; ++c) dwj[c] += g[c] * r[c];
          }
        }
      }
    });
    scalar_t* pdw = dwt.data_ptr<scalar_t>();
    for (int th = 0; th < threads; ++th) {
      const scalar_t* p = partial.data() + static_cast<size_t>(th) * K * C;
      for (int64_t i = 0; i < K * C; ++i) pdw[i] += p[i];
    }
  });
  return {dx, dtail, dwt.t().contiguous()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def("short_conv(Tensor x, Tensor? tail, Tensor w, Tensor? cu_seqlens) -> Tensor");
  m.def("short_conv_backward(Tensor dy, Tensor x, Tensor? tail, Tensor w, Tensor? cu_seqlens) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("short_conv", short_conv);
  m.impl("short_conv_backward", short_conv_backward);
}
