// The rows that the fused chunked kernels walk, one task each (chunked.cpp, gated.cpp,
// gated_backward.cpp, delta.cpp, kda.cpp; design §17 for packed sequences).
//
// Unpacked, q (B, H, N, ·): the B·H (batch, head) rows of N tokens. Row r starts at token r·N of the
// flattened (B·H·N) time axis, its initial and final states are entry r of the (B, H, …) states, and
// the states it saves for the backward (one per block of tokens) are entries r·⌈N/block⌉ … .
//
// Packed, cu_seqlens [S+1] of S sequences laid end to end along the T tokens of a batch of 1: the S·H
// (sequence, head) rows. Row r = n·H + h holds tokens cu[n] … cu[n+1] − 1 of head h (it starts at
// h·T + cu[n]), its states are entry r of the (S, H, …) states, and its saved block states follow
// those of the rows before it (`first_block`). A kernel walks each row from its own first token with
// its own state: a chunk never holds two sequences (it is cut at the row's end), the state resets at
// every boundary (to initial_state[n]), and a row of length 0 leaves its initial state as it was.
// Tasks run head by head (`row`): the threads of at::parallel_for take whole heads of every sequence,
// so that sequences of unequal lengths still split evenly when the heads do.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace {

class Rows {
 public:
  // q (B, H, N, ·); cu_seqlens a 1-D integer tensor [S+1] (then B must be 1), or none; block: tokens
  // per saved state
  Rows(const char* op, const at::Tensor& q, const c10::optional<at::Tensor>& cu_seqlens, int64_t block)
      : heads_(q.size(1)) {
    const int64_t B = q.size(0), H = q.size(1), N = q.size(2);
    if (!cu_seqlens.has_value()) {
      sequences_ = B;
      const int64_t per = (N + block - 1) / block;
      for (int64_t r = 0; r < B * H; ++r) add(r * N, N, per);
      return;
    }
    const at::Tensor& cu_in = *cu_seqlens;
    TORCH_CHECK(cu_in.dim() == 1 && cu_in.numel() >= 2 && !cu_in.is_floating_point() && !cu_in.is_complex(), op,
                ": cu_seqlens must be a 1-D integer tensor [S+1]");
    TORCH_CHECK(B == 1, op, ": with cu_seqlens the batch must be 1, got ", B);
    const at::Tensor cu_t = cu_in.to(at::kCPU, at::kLong).contiguous();
    const int64_t* cu = cu_t.data_ptr<int64_t>();
    sequences_ = cu_t.numel() - 1;
    TORCH_CHECK(cu[0] == 0 && cu[sequences_] == N, op, ": cu_seqlens must run from 0 to N = ", N);
    for (int64_t n = 0; n < sequences_; ++n) {
      TORCH_CHECK(cu[n + 1] >= cu[n], op, ": cu_seqlens must be non-decreasing");
      for (int64_t h = 0; h < H; ++h) {
        const int64_t len = cu[n + 1] - cu[n];
        add(h * N + cu[n], len, (len + block - 1) / block);
      }
    }
    packed_ = true;
  }

  int64_t count() const { return static_cast<int64_t>(start_.size()); }  // rows (= states)
  int64_t sequences() const { return sequences_; }  // the states' leading dim: B, or S
  int64_t start(int64_t r) const { return start_[r]; }
  int64_t length(int64_t r) const { return length_[r]; }
  int64_t first_block(int64_t r) const { return first_block_[r]; }
  int64_t blocks() const { return blocks_; }  // saved block states of all rows
  // the row of task i: head-major when packed (task h·S + n is row n·H + h)
  int64_t row(int64_t i) const {
    if (!packed_) return i;
    return (i % sequences_) * heads_ + i / sequences_;
  }

 private:
  void add(int64_t start, int64_t length, int64_t blocks) {
    start_.push_back(start);
    length_.push_back(length);
    first_block_.push_back(blocks_);
    blocks_ += blocks;
  }

  int64_t heads_, sequences_ = 0, blocks_ = 0;
  bool packed_ = false;
  std::vector<int64_t> start_, length_, first_block_;
};

}  // namespace
