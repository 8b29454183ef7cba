// The floating-point operations the fused kernels' products execute, counted as they run: every
// gemm_rm (2·M·N·K) and every unit-triangular solve of the delta family (c·(c − 1)·n for c rows and n
// columns). `linattn bench ops --roofline` reads it to report GFLOP/s of the algorithm actually run —
// the backward recomputes chunk states and scores, which a "3 × forward" count leaves out — and the
// tests check the design doc's FLOP formulas against it. Elementwise work is not counted. One counter
// for the whole extension (external linkage, like pool.h), added to once per product (relaxed).
#pragma once

#include <atomic>
#include <cstdint>

namespace linattn_count {

inline std::atomic<int64_t>& executed_flops() {
  static std::atomic<int64_t> flops{0};
  return flops;
}

inline void add_flops(int64_t n) { executed_flops().fetch_add(n, std::memory_order_relaxed); }

}  // namespace linattn_count
