// The pieces of the delta family's fused chunked kernels shared by delta.cpp (no gate, one decay per
// head) and kda.cpp (one decay per key channel): the saved-state block size, the strip triangular
// solve, loading (and L2-normalizing) rows, the corrected values, row scalings, the chain through the
// normalization, the checks and cotangents of the operators' entries and the backward's walk over the saved
// blocks. Internal linkage (one copy per file), like common.h.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "blas.h"
#include "common.h"
#include "pool.h"
#include "rows.h"
#include "step_rows.h"

namespace {

constexpr int64_t kBlock = 256;  // tokens per saved state (rounded to whole chunks)

int64_t block_tokens(int64_t chunk) { return std::max<int64_t>(chunk, (kBlock / chunk) * chunk); }

bool delta_has_blas() {
  return has_blas() && blas_trsm<float>() != nullptr && blas_trsm<double>() != nullptr;
}

// B ← L⁻¹ B, or L⁻ᵀ B with trans, in place on the row-major c×E matrix B; L is unit lower triangular
// with its strictly lower part in the row-major c×c matrix A (diagonal and upper part not read). By
// substitution on strips of W columns held in registers, G rows at a time: the rows solved before the
// group enter all G rows at once (each loaded strip feeds 2G independent FMA chains), then the group's own
// triangle in order (c = 64, E = 128, fp32, one core: 3.8 µs; one row at a time with two partial sums,
// as before, 8.8 µs); columns beyond the last whole strip go to the BLAS trsm.
template <typename Acc>
LINATTN_CLONES void solve_strips(bool trans, int c, int64_t E, const Acc* __restrict__ A, Acc* __restrict__ B) {
  constexpr int W = 128 / sizeof(Acc);  // two 512-bit registers
  constexpr int G = 4;                  // 2G accumulators: 6 or 8 rows measured slower (register spills)
  linattn_count::add_flops(int64_t{c} * (c - 1) * E);
  int64_t x0 = 0;
  for (; x0 + W <= E; x0 += W) {
    for (int g0 = 0; g0 < c; g0 += G) {
      const int m = std::min(G, c - g0);
      int rows[G];  // the group's rows in solve order; past m, repeats of its last (computed, not stored)
      for (int r = 0; r < G; ++r) rows[r] = trans ? c - 1 - (g0 + std::min(r, m - 1)) : g0 + std::min(r, m - 1);
      Acc acc[G][W];
      for (int r = 0; r < G; ++r) {
#pragma omp simd
        for (int x = 0; x < W; ++x) acc[r][x] = B[rows[r] * E + x0 + x];
      }
      for (int jj = 0; jj < g0; ++jj) {  // the rows solved before the group: L_ij = A_ij, or A_ji with trans
        const int j = trans ? c - 1 - jj : jj;
        const Acc* __restrict__ bj = B + j * E + x0;
        Acc a[G];
        for (int r = 0; r < G; ++r) a[r] = trans ? A[int64_t(j) * c + rows[r]] : A[int64_t(rows[r]) * c + j];
        for (int r = 0; r < G; ++r) {
#pragma omp simd
          for (int x = 0; x < W; ++x) acc[r][x] -= a[r] * bj[x];
        }
      }
      for (int r = 1; r < m; ++r) {  // the group's own triangle
        for (int s = 0; s < r; ++s) {
          const Acc a = trans ? A[int64_t(rows[s]) * c + rows[r]] : A[int64_t(rows[r]) * c + rows[s]];
#pragma omp simd
          for (int x = 0; x < W; ++x) acc[r][x] -= a * acc[s][x];
        }
      }
      for (int r = 0; r < m; ++r) {
#pragma omp simd
        for (int x = 0; x < W; ++x) B[rows[r] * E + x0 + x] = acc[r][x];
      }
    }
  }
  if (x0 < E) solve_unit_lower<Acc>(trans, c, static_cast<int>(E - x0), A, B + x0, static_cast<int>(E));
}

// c rows of q or k (D wide) as Acc in dst: the rows themselves, or with l2norm x / √(‖x‖² + ε), the
// factor 1 / √(‖x‖² + ε) of row i in rnorm[i]
template <typename T, typename Acc>
LINATTN_CLONES void load_rows(const T* __restrict__ src, Acc* __restrict__ dst, Acc* __restrict__ rnorm, int c,
                              int64_t D, bool l2norm) {
  const Acc* from;  // the rows the norms are taken of: the source itself, or (bf16) its widened copy
  if constexpr (std::is_same<T, Acc>::value) {
    if (!l2norm) {
      std::memcpy(dst, src, sizeof(Acc) * c * D);
      return;
    }
    from = src;
  } else {
    widen_bf16(src, dst, int64_t(c) * D);
    if (!l2norm) return;
    from = dst;
  }
  for (int i = 0; i < c; ++i) {  // one pass over each row: its norm, then the scaled copy (in place for bf16)
    const Acc* x = from + i * D;
    Acc* y = dst + i * D;
    Acc ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
    const Acc r = inverse_norm(x, D, ss);
    rnorm[i] = r;
#pragma omp simd  // element d reads and writes only index d
    for (int64_t d = 0; d < D; ++d) y[d] = x[d] * r;
  }
}

// The products of a chunk's front with the state S (D×E): SK = K̂ S and QS = alpha · Q̂ S from KQ =
// [K̂; Q̂] (2c×D); QS = nullptr: K̂ S alone; QS = SK + c·E: one stacked gemm of 2c rows (alpha 1)
template <typename Acc>
void front_products(const Acc* KQ, const Acc* S, int c, int d, int e, Acc* SK, Acc* QS, Acc alpha) {
  if (QS == SK + int64_t(c) * e && alpha == Acc(1)) {
    gemm_rm<Acc>(false, false, 2 * c, e, d, KQ, d, S, e, Acc(0), SK, e);
    return;
  }
  gemm_rm<Acc>(false, false, c, e, d, KQ, d, S, e, Acc(0), SK, e);
  if (QS != nullptr) gemm_rm<Acc>(false, false, c, e, d, KQ + int64_t(c) * d, d, S, e, Acc(0), QS, e, alpha);
}

// Where a chunk's outputs are formed: in the output rows themselves when they hold Acc (fp32, fp64),
// else in the work rows `work` (bf16: rounded out once after)
template <typename T, typename Acc>
inline Acc* direct_output(T* out, Acc* work) {
  if constexpr (std::is_same<T, Acc>::value) {
    return out;
  } else {
    return work;
  }
}

// V'_i = β_i X_i with X_i = V_i − e^{b_i} (K̂S)_i (eb = nullptr: 1), X kept when X != nullptr
template <typename T, typename Acc>
LINATTN_CLONES void corrected_values(const T* __restrict__ V, const Acc* __restrict__ KS, const Acc* __restrict__ eb,
                                     const Acc* __restrict__ beta, Acc* __restrict__ X, Acc* __restrict__ Vp, int c,
                                     int64_t E) {
  for (int i = 0; i < c; ++i) {
    const Acc e = eb != nullptr ? eb[i] : Acc(1), bi = beta[i];
#pragma omp simd
    for (int64_t x = 0; x < E; ++x) {
      const Acc xi = static_cast<Acc>(V[i * E + x]) - e * KS[i * E + x];
      if (X != nullptr) X[i * E + x] = xi;
      Vp[i * E + x] = bi * xi;
    }
  }
}

// Y_i = a_i X_i for the c rows of X (n wide); in place when Y == X
template <typename Acc>
LINATTN_CLONES void scale_rows(const Acc* X, const Acc* __restrict__ a, Acc* Y, int c, int64_t n) {
  for (int i = 0; i < c; ++i) {
    const Acc ai = a[i];
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) Y[i * n + x] = ai * X[i * n + x];
  }
}

// out (T) = s · X for n values
template <typename T, typename Acc>
LINATTN_CLONES void store_scaled(Acc* __restrict__ X, Acc s, T* __restrict__ out, int64_t n) {
  if constexpr (std::is_same<T, Acc>::value) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = s * X[i];
  } else {
    if (s != Acc(1)) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) X[i] *= s;
    }
    narrow_bf16(X, out, n);
  }
}

template <typename Acc>
LINATTN_CLONES void scale_all(Acc* __restrict__ X, Acc s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) X[i] *= s;
}

// One row's inputs: q, k (N×D), v (N×E), β, g (N, or N×D per key channel; nullptr without a gate)
template <typename T, typename Acc>
struct Row {
  const T *q, *k, *v;
  const Acc *beta, *g;
};

// Outputs of the backward for one row
template <typename T, typename Acc>
struct RowGrads {
  const T* dO;
  T *dq, *dk, *dv;
  Acc *dbeta, *dg;  // dg nullptr without a gate
};

// ∂L/∂x of n = x / √(‖x‖² + ε) for c rows (l2norm), or ∂L/∂x = ∂L/∂n: r (dn − n (n · dn)), as T
template <typename T, typename Acc>
LINATTN_CLONES void chain_rows(const Acc* __restrict__ dn, const Acc* __restrict__ n, const Acc* __restrict__ rnorm,
                               bool l2norm, T* __restrict__ out, int c, int64_t D) {
  for (int i = 0; i < c; ++i) {
    const Acc* __restrict__ g = dn + i * D;
    const Acc* __restrict__ x = n + i * D;
    T* __restrict__ y = out + i * D;
    if (!l2norm) {
      for (int64_t d = 0; d < D; ++d) y[d] = static_cast<T>(g[d]);
      continue;
    }
    Acc dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += x[d] * g[d];
    const Acc r = rnorm[i];
    for (int64_t d = 0; d < D; ++d) y[d] = static_cast<T>(r * (g[d] - x[d] * dot));
  }
}

// Σ_d a_i X_id Y_id per row i (n wide) added to out[i] with sign s
template <typename Acc>
LINATTN_CLONES void add_row_dots(const Acc* __restrict__ X, const Acc* __restrict__ Y, const Acc* __restrict__ a, Acc s,
                                 Acc* __restrict__ out, int c, int64_t n) {
  for (int i = 0; i < c; ++i) {
    Acc dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t x = 0; x < n; ++x) dot += X[i * n + x] * Y[i * n + x];
    out[i] += s * (a != nullptr ? a[i] : Acc(1)) * dot;
  }
}

// Y_i += s a_i X_i for the c rows (n wide)
template <typename Acc>
LINATTN_CLONES void add_scaled_rows(const Acc* __restrict__ X, const Acc* __restrict__ a, Acc s, Acc* __restrict__ Y,
                                    int c, int64_t n) {
  for (int i = 0; i < c; ++i) {
    const Acc ai = s * a[i];
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) Y[i * n + x] += ai * X[i * n + x];
  }
}

// The ungated score cotangents of row i of a chunk (c wide): with H_i the cotangent of the row's
// solved scores, H_ij ← −β_i H_ij below the diagonal (j < i), returning Σ_j −H_ij (k̂_i·k̂_j) (the row's
// part of ∂L/∂β_i; Ki: the row of k̂k̂ᵀ); H_ij = 0 from the diagonal on, and the score row P_i's
// cotangent zeroed above it (j > i). Shared by the delta rule's and KDA's backward.
template <typename Acc>
inline Acc ungated_cotangent_row(Acc* __restrict__ Hi, Acc* __restrict__ dPi, const Acc* __restrict__ Ki, Acc bi,
                                 int i, int c) {
  Acc sb = 0;
#pragma omp simd reduction(+ : sb)
  for (int j = 0; j < i; ++j) {
    const Acc da = -Hi[j];
    sb += da * Ki[j];
    Hi[j] = da * bi;
  }
  for (int j = i; j < c; ++j) Hi[j] = Acc(0);
  for (int j = i + 1; j < c; ++j) dPi[j] = Acc(0);
  return sb;
}

// Where the rows of a call's inputs start: q, k (D values a token), v (E), β (1) and g (g_width: 1, or D
// per key channel; none without a gate) over the flattened (B·H·N) tokens; row(t): the Row from token t.
template <typename T, typename Acc>
struct RowInputs {
  const T *q, *k, *v;
  const Acc *beta, *g;
  int64_t D, E, g_width;

  RowInputs(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& beta_,
            const at::Tensor* g_, int64_t g_width_)
      : q(q_.data_ptr<T>()), k(k_.data_ptr<T>()), v(v_.data_ptr<T>()), beta(beta_.data_ptr<Acc>()),
        g(g_ != nullptr ? g_->data_ptr<Acc>() : nullptr), D(q_.size(3)), E(v_.size(3)), g_width(g_width_) {}

  Row<T, Acc> row(int64_t t) const {
    return {q + t * D, k + t * D, v + t * E, beta + t, g != nullptr ? g + t * g_width : nullptr};
  }
  // Queues tokens [t, t + n) of q, k, v, β and g to be hinted into cache as the products before their
  // chunk run (prefetch.h); what is still queued from the chunk before is issued first
  void hint(int64_t t, int64_t n) const {
    if (n <= 0) return;
    prefetch_queue().flush();
    const Row<T, Acc> at = row(t);
    prefetch_soon(at.q, n * D * int64_t(sizeof(T)));
    prefetch_soon(at.k, n * D * int64_t(sizeof(T)));
    prefetch_soon(at.v, n * E * int64_t(sizeof(T)));
    prefetch_soon(at.beta, n * int64_t(sizeof(Acc)));
    if (at.g != nullptr) prefetch_soon(at.g, n * g_width * int64_t(sizeof(Acc)));
  }
};

// The same for the backward's tensors: dO read, dq, dk, dv, dβ and dg (none without a gate) written
template <typename T, typename Acc>
struct RowGradOutputs {
  const T* dO;
  T *dq, *dk, *dv;
  Acc *dbeta, *dg;
  int64_t D, E, g_width;

  RowGradOutputs(const at::Tensor& dO_, at::Tensor& dq_, at::Tensor& dk_, at::Tensor& dv_, at::Tensor& dbeta_,
                 at::Tensor* dg_, int64_t g_width_)
      : dO(dO_.data_ptr<T>()), dq(dq_.data_ptr<T>()), dk(dk_.data_ptr<T>()), dv(dv_.data_ptr<T>()),
        dbeta(dbeta_.data_ptr<Acc>()), dg(dg_ != nullptr ? dg_->data_ptr<Acc>() : nullptr), D(dq_.size(3)),
        E(dv_.size(3)), g_width(g_width_) {}

  RowGrads<T, Acc> row(int64_t t) const {
    return {dO + t * E, dq + t * D, dk + t * D, dv + t * E, dbeta + t, dg != nullptr ? dg + t * g_width : nullptr};
  }
  // Queues tokens [t, t + n) of dO (read) and the gradients (written) as RowInputs::hint does (after it:
  // no flush here)
  void hint(int64_t t, int64_t n) const {
    if (n <= 0) return;
    const RowGrads<T, Acc> at = row(t);
    const int64_t b = sizeof(T), a = sizeof(Acc);
    prefetch_soon(at.dO, n * E * b);
    prefetch_soon(at.dq, n * D * b, true);
    prefetch_soon(at.dk, n * D * b, true);
    prefetch_soon(at.dv, n * E * b, true);
    prefetch_soon(at.dbeta, n * a, true);
    if (at.dg != nullptr) prefetch_soon(at.dg, n * g_width * a, true);
  }
};

// The forward of row r chunk by chunk, in order: step(in, S, t0, c, tok) advances the row's state S (its
// D·E values in S_all) over the row's tokens t0 … t0 + c − 1 (tok = the first one's index in the flattened
// B·H·N tokens, where its outputs go); with saved_all (not null) S is first copied, at every block's start,
// to the row's saved block states.
template <typename T, typename Acc, typename Step>
void row_forward(const Rows& rows, int64_t r, const RowInputs<T, Acc>& x, Acc* S_all, Acc* saved_all, int64_t chunk,
                 Step&& step) {
  const int64_t N = rows.length(r), DE = x.D * x.E, block = block_tokens(chunk);
  const Row<T, Acc> in = x.row(rows.start(r));
  Acc* S = S_all + r * DE;
  Acc* saved = saved_all != nullptr ? saved_all + rows.first_block(r) * DE : nullptr;
  for (int64_t t0 = 0; t0 < N; t0 += chunk) {
    if (saved != nullptr && t0 % block == 0) std::copy(S, S + DE, saved + (t0 / block) * DE);
    x.hint(rows.start(r) + t0 + chunk, std::min(chunk, N - t0 - chunk));
    step(in, S, t0, static_cast<int>(std::min(chunk, N - t0)), rows.start(r) + t0);
  }
}

// The backward of row r by its saved block states (saved_all, as row_forward saved them), last block first:
// the block's state is copied to state0, forward(in, j, t0, c, more) recomputes its chunk j (the row's tokens
// t0 … t0 + c − 1, chunks in order; more: another chunk of the block follows), then backward(in, out, R, j,
// t0, c) walks the chunks back from the block's last, R the row's state cotangent (its D·E values in R_all).
template <typename T, typename Acc, typename Forward, typename Backward>
void row_backward(const Rows& rows, int64_t r, const RowInputs<T, Acc>& x, const RowGradOutputs<T, Acc>& dx,
                  const Acc* saved_all, Acc* R_all, int64_t chunk, Acc* state0, Forward&& forward,
                  Backward&& backward) {
  const int64_t N = rows.length(r), DE = x.D * x.E, block = block_tokens(chunk);
  const Row<T, Acc> in = x.row(rows.start(r));
  const RowGrads<T, Acc> out = dx.row(rows.start(r));
  const Acc* saved = saved_all + rows.first_block(r) * DE;
  Acc* R = R_all + r * DE;
  for (int64_t blk = (N + block - 1) / block - 1; blk >= 0; --blk) {
    const int64_t s = blk * block, nch = (std::min(N, s + block) - s + chunk - 1) / chunk;
    std::copy(saved + blk * DE, saved + (blk + 1) * DE, state0);
    for (int64_t j = 0; j < nch; ++j) {
      const int64_t t0 = s + j * chunk;
      if (j + 1 < nch) x.hint(rows.start(r) + t0 + chunk, std::min(chunk, N - t0 - chunk));
      forward(in, j, t0, static_cast<int>(std::min(chunk, N - t0)), j + 1 < nch);
    }
    for (int64_t j = nch - 1; j >= 0; --j) {
      const int64_t t0 = s + j * chunk;
      if (j > 0) {  // the chunk before: its inputs again, dO and the gradients it writes
        x.hint(rows.start(r) + t0 - chunk, chunk);
        dx.hint(rows.start(r) + t0 - chunk, chunk);
      }
      backward(in, out, R, j, t0, static_cast<int>(std::min(chunk, N - t0)));
    }
  }
}

// q, k (B, H, N, D), v (B, H, N, E) of one dtype; β (B, H, N), g (B, H, N; per_channel: B, H, N, D) or
// none, and S (D×E matrices: one per row, the initial states, or the saved block states when saved) in
// Acc (state_error: what to say when their number does not match). Returns the rows (rows.h) of the call.
inline Rows check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& beta, const at::Tensor* g, bool per_channel, const at::Tensor& S,
                         bool saved, int64_t chunk, const c10::optional<at::Tensor>& cu_seqlens,
                         const char* state_error) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3),
              op, " expects q, k (B, H, N, D) and v (B, H, N, E)");
  TORCH_CHECK(chunk > 0, op, ": chunk must be positive");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op, ": q, k, v must share a dtype");
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(beta.scalar_type() == acc && S.scalar_type() == acc && (g == nullptr || g->scalar_type() == acc), op,
              ": beta, g and the state must be float64 for float64 inputs, else float32");
  const bool g_fits = g == nullptr || (per_channel ? g->sizes() == q.sizes() : g->numel() == beta.numel());
  TORCH_CHECK(beta.numel() == q.size(0) * q.size(1) * q.size(2) && g_fits, op,
              per_channel ? ": beta must be (B, H, N) and g (B, H, N, D)" : ": beta and g must be (B, H, N)");
  TORCH_CHECK(delta_has_blas(), op, ": no BLAS gemm/trsm found in torch");
  Rows rows(op, q, cu_seqlens, block_tokens(chunk));
  TORCH_CHECK(S.numel() == (saved ? rows.blocks() : rows.count()) * q.size(3) * v.size(3), op, ": ", state_error);
  return rows;
}

// The tensors of a chunked backward (delta_chunked_backward, kda_chunked_backward) after check_inputs: q, k,
// v, β and the saved block states contiguous; dO, do in v's dtype, contiguous, shaped like v; R, the cotangent
// of the rows' final states (a copy of dS, zeros without one) as D×E rows in the states' dtype, which the
// backward turns into that of the initial states; the gradients to fill: dq, dk, dv like q, k, v and dβ like
// β (op: the operator's name in errors).
struct BackwardTensors {
  at::Tensor q, k, v, beta, S_blocks, dO, R, dq, dk, dv, dbeta;

  BackwardTensors(const char* op, const Rows& rows, const at::Tensor& q_in, const at::Tensor& k_in,
                  const at::Tensor& v_in, const at::Tensor& beta_in, const at::Tensor& S_blocks_in,
                  const at::Tensor& do_in, const c10::optional<at::Tensor>& dS)
      : q(q_in.contiguous()), k(k_in.contiguous()), v(v_in.contiguous()), beta(beta_in.contiguous()),
        S_blocks(S_blocks_in.contiguous()), dO(do_in.to(v.scalar_type()).contiguous()) {
    TORCH_CHECK(dO.sizes() == v.sizes(), op, ": do must be shaped like v");
    const int64_t nr = rows.count(), D = q.size(3), E = v.size(3);
    R = dS.has_value() ? dS->to(S_blocks.options()).contiguous().clone() : at::zeros({nr, D, E}, S_blocks.options());
    TORCH_CHECK(R.numel() == nr * D * E, op, ": dS must be shaped like the state");
    dq = linattn_pool::empty_result(q.sizes(), q.options());
    dk = linattn_pool::empty_result(k.sizes(), k.options());
    dv = linattn_pool::empty_result(v.sizes(), v.options());
    dbeta = at::empty(beta.sizes(), S_blocks.options());
  }

  // ∂L/∂S0 (S, H, D, E), S the states' leading dim (rows.h), once the backward has run
  at::Tensor initial_state_grad(const Rows& rows) const {
    return R.view({rows.sequences(), q.size(1), q.size(3), v.size(3)});
  }
};

}  // namespace
