// Fused CPU operators for KDA, the delta rule with one decay per key channel (design §13.8;
// linattn.ops.delta with g (B, H, N, D)), per (batch, head) row:
//
//   S_t = (I − β_t k̂_t k̂_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k̂_t v_tᵀ,   o_t = scale · S_tᵀ q̂_t
//
// `kda_chunked` runs a row chunk by chunk in the WY/UT form of delta.cpp with the decays applied
// channel by channel. Per chunk of c tokens, with b (c×D) the cumulative sums of the gates clamped at
// kChannelFloor, in double, K̂_b = K̂ ⊙ e^b, Q̂_b = Q̂ ⊙ e^b, K̂_l = K̂ ⊙ e^{b_c − b}:
//
//   KK_ij = Σ_d k̂_id k̂_jd e^{b_id − b_jd} (j < i),   P_ij = Σ_d q̂_id k̂_jd e^{b_id − b_jd} (j ≤ i)
//   A = diag(β) KK,   [K̂_b; Q̂_b] S -> X = V − K̂_b S,   V' = (I + A)⁻¹ diag(β) X
//   O = Q̂_b S + P V',   S ← Diag(e^{b_c}) S + K̂_lᵀ V'
//
// Every exponential of the chunk form has a non-positive argument (b, b_c − b, b_a − b_j below), and
// the differences of b are taken in double (design §13.3). The scores are the one place where
// e^{b_i − b_j} does not split into factors ≤ 1: they are formed by row blocks (`row_blocks`, the
// sub-chunks of this kernel). The chunk's rows are cut greedily into blocks [a, z) over which no
// channel decays by more than kSpan after the block's first row (max_d b_ad − b_(z−1)d ≤ kSpan; a row
// alone always qualifies), and the rows of a block take their scores against all columns j < z in one
// gemm about the row a:
//
//   (x_i ⊙ f_i) · (k̂_j ⊙ h_j),   f_i = e^{b_i − b_a} ≤ 1,   h_j = e^{b_a − b_j} ≤ 1 (j ≤ a), 1/f_j ≤ e^{kSpan} (j > a)
//
// so each product is one true term x_id k_jd e^{b_id − b_jd}, nothing overflows and nothing cancels
// (the gated family's vector gates bound their pieces the same way, gated.h). With realistic gates a
// chunk is one block and the scores one gemm of [K̂ ⊙ f; Q̂ ⊙ f] by (K̂ / f)ᵀ, as Gated DeltaNet's
// [K̂; Q̂] K̂ᵀ; a gate of −1e30 (clamped at −80) starts a block of its own, and gates of −1e4 on every
// token make every row a block (correct, slower). f is exact to about an ulp (its exponent, in
// [−kSpan, 0], is rounded to Acc in two parts), so that f_i / f_j is e^{b_i − b_j} to a few ulps even
// where both exponents are near −kSpan.
//
// The training forward saves the state entering every block of kBlock tokens (delta.h);
// `kda_chunked_backward` walks each row's saved blocks in reverse, recomputes a block's chunks from
// its saved state, then runs each chunk's backward (linattn/ops/delta/chunked.py's formulas with the
// decays per channel), carrying ∂L/∂S from chunk to chunk. The gate's gradient: every factor e^{±b}
// contributes "value ⊙ its gradient" to ∂L/∂b per channel (rows of K̂_b, Q̂_b to b_i; rows of K̂_l
// subtracted from b_i and added to b_c; Diag(e^{b_c}) S to b_c; the scores' left factors x_i ⊙ f_i to
// b_i and right factors k̂_j ⊙ h_j subtracted from b_j, where the reference row a cancels), then
// ∂L/∂g_s = Σ_{t ≥ s in the chunk} ∂L/∂b_t, 0 for a g below the floor.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <tuple>

#include "blas.h"
#include "common.h"
#include "delta.h"
#include "pool.h"
#include "rows.h"
#include "step_rows.h"

namespace {

using linattn_pool::empty_result;

// Each g is clamped at this floor before b is summed (CHANNEL_GATE_FLOOR of linattn/ops/delta/subchunk.py):
// e^{−80} ≈ 1.8e-35 forgets as completely as a stronger gate, and b stays exact in double
constexpr double kChannelFloor = -80.0;
// The largest decay of any channel inside a row block after its first row: h ≤ e^40 ≈ 2.4e17
constexpr double kSpan = 40.0;

// b (c×D) = the cumulative sums over the chunk of max(g, kChannelFloor), in double, and elast = e^{b_c} (D).
// Returns whether every g of the chunk is a finite log-decay ≤ 0 (gates_valid; the forward's check).
template <typename Acc>
LINATTN_CLONES bool channel_gates(const Acc* __restrict__ g, int c, int64_t D, double* __restrict__ b,
                                  Acc* __restrict__ elast) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t d = 0; d < D; ++d) {
    b[d] = std::max(static_cast<double>(g[d]), kChannelFloor);
    bad |= invalid_gate(g[d]);
  }
  for (int i = 1; i < c; ++i) {
    const double* __restrict__ prev = b + (i - 1) * D;
    double* __restrict__ cur = b + i * D;
    const Acc* __restrict__ gi = g + i * D;
#pragma omp simd reduction(| : bad)
    for (int64_t d = 0; d < D; ++d) {
      cur[d] = prev[d] + std::max(static_cast<double>(gi[d]), kChannelFloor);
      bad |= invalid_gate(gi[d]);
    }
  }
  const double* __restrict__ last = b + int64_t(c - 1) * D;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) elast[d] = exp_nonpositive(static_cast<Acc>(last[d]));
  return bad == 0;
}

// Cuts the c rows into blocks [starts[k], starts[k + 1]): a row z starts a new block when some channel
// has decayed by more than kSpan since the current block's first row a (max_d b_ad − b_zd > kSpan).
// Returns the number of blocks nb; starts[nb] = c.
LINATTN_CLONES int row_blocks(const double* __restrict__ b, int c, int64_t D, int* __restrict__ starts) {
  int nb = 0, a = 0;
  starts[nb++] = 0;
  for (int i = 1; i < c; ++i) {
    const double* __restrict__ ba = b + int64_t(a) * D;
    const double* __restrict__ bi = b + int64_t(i) * D;
    double span = 0;
#pragma omp simd reduction(max : span)
    for (int64_t d = 0; d < D; ++d) span = std::max(span, ba[d] - bi[d]);
    if (span > kSpan) starts[nb++] = a = i;
  }
  starts[nb] = c;
  return nb;
}

// f_i = e^{x} for an exponent x = b_i − b_a in double, in [−kSpan, 0]: x is rounded to Acc as hi + lo
// and f = e^{hi} (1 + lo) (a float hi alone would be off by up to kSpan · 2⁻²⁴ in the exponent, and
// f_i / f_j by twice that relatively)
template <typename Acc>
inline Acc block_decay(double x) {
  const Acc hi = static_cast<Acc>(x);
  const Acc lo = static_cast<Acc>(x - static_cast<double>(hi));
  const Acc e = exp_nonpositive(hi);
  return e + e * lo;
}

// The chunk's factors in one pass over its rows (KQ = [K̂; Q̂], 2c×D; every output c×D but KQb 2c×D):
// eb = e^b, el = e^{b_c − b}, f_i = e^{b_i − b_a} (a the first row of i's block, block_decay) and
// fi = 1 / f, and the rows they scale, KQb = [K̂ ⊙ e^b; Q̂ ⊙ e^b], Kl = K̂ ⊙ e^{b_c − b}; with L and R
// (one block only: a = 0) also the scores' factors L = [K̂ ⊙ f; Q̂ ⊙ f] (2c×D) and R = K̂ ⊙ fi.
// One block (nb = 1, every channel within kSpan of row 0 over the chunk) takes one exponential per
// entry: eb = e^{b_0} f and el = f_c fi (edge, 2D long: e^{b_0} and f_c). Both products stay in range
// (f, fi, f_c within e^{±kSpan}) and are as close as the direct e^{(Acc) b}, e^{(Acc)(b_c − b)}, whose
// rounded exponents are off by up to |b| · 2⁻²⁴ (the products: a few ulp). There, without keep (the
// forward), eb, el, f and fi are not stored: only the rows they scale are read after.
template <typename Acc>
LINATTN_CLONES void chunk_factors(const double* __restrict__ b, const int* starts, int nb, const Acc* __restrict__ KQ,
                                  int c, int64_t D, Acc* __restrict__ eb, Acc* __restrict__ el, Acc* __restrict__ f,
                                  Acc* __restrict__ fi, Acc* __restrict__ KQb, Acc* __restrict__ Kl,
                                  Acc* __restrict__ L, Acc* __restrict__ R, Acc* __restrict__ edge, bool keep) {
  const int64_t cD = int64_t(c) * D;
  const double* __restrict__ last = b + cD - D;
  if (nb == 1) {
    Acc* __restrict__ e0 = edge;
    Acc* __restrict__ fc = edge + D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      e0[d] = exp_nonpositive(static_cast<Acc>(b[d]));
      fc[d] = block_decay<Acc>(last[d] - b[d]);
    }
  }
  for (int k = 0; k < nb; ++k) {
    const double* __restrict__ ba = b + int64_t(starts[k]) * D;
    for (int i = starts[k]; i < starts[k + 1]; ++i) {
      const int64_t o = int64_t(i) * D;
      if (nb == 1) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          const Acc fr = block_decay<Acc>(b[o + d] - ba[d]), fir = Acc(1) / fr;
          const Acc e1 = edge[d] * fr, e2 = edge[D + d] * fir;
          const Acc kk = KQ[o + d], qq = KQ[cD + o + d];
          if (keep) {
            f[o + d] = fr;
            fi[o + d] = fir;
            eb[o + d] = e1;
            el[o + d] = e2;
          }
          KQb[o + d] = kk * e1;
          KQb[cD + o + d] = qq * e1;
          Kl[o + d] = kk * e2;
          if (L != nullptr) {
            L[o + d] = kk * fr;
            L[cD + o + d] = qq * fr;
            R[o + d] = kk * fir;
          }
        }
        continue;
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        const double bi = b[o + d];
        const Acc fr = block_decay<Acc>(bi - ba[d]);
        const Acc e1 = exp_nonpositive(static_cast<Acc>(bi)), e2 = exp_nonpositive(static_cast<Acc>(last[d] - bi));
        const Acc kk = KQ[o + d], qq = KQ[cD + o + d];
        f[o + d] = fr;
        fi[o + d] = Acc(1) / fr;
        eb[o + d] = e1;
        el[o + d] = e2;
        KQb[o + d] = kk * e1;
        KQb[cD + o + d] = qq * e1;
        Kl[o + d] = kk * e2;
      }
    }
  }
}

// The right factor of block [a, z): H_j = e^{b_a − b_j} for j < a (an exponent ≤ 0), fi_j for
// a ≤ j < z; R = K̂ ⊙ H (z×D)
template <typename Acc>
LINATTN_CLONES void right_factors(const Acc* __restrict__ K, const double* __restrict__ b,
                                  const Acc* __restrict__ fi, int a, int z, int64_t D, Acc* __restrict__ R,
                                  Acc* __restrict__ H) {
  const double* __restrict__ ba = b + int64_t(a) * D;
  for (int j = 0; j < a; ++j) {
    const double* __restrict__ bj = b + int64_t(j) * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const Acc h = exp_nonpositive(static_cast<Acc>(ba[d] - bj[d]));
      H[j * D + d] = h;
      R[j * D + d] = K[j * D + d] * h;
    }
  }
  for (int64_t x = int64_t(a) * D; x < int64_t(z) * D; ++x) {
    H[x] = fi[x];
    R[x] = K[x] * fi[x];
  }
}

// The left factor of block [a, z) (m = z − a rows): L = [K̂ ⊙ f; Q̂ ⊙ f] of its rows (2m×D)
template <typename Acc>
LINATTN_CLONES void left_factors(const Acc* __restrict__ KQ, const Acc* __restrict__ f, int c, int a, int z,
                                 int64_t D, Acc* __restrict__ L) {
  const int64_t m = z - a;
  for (int64_t x = 0; x < m * D; ++x) {
    const Acc fx = f[a * D + x];
    L[x] = KQ[a * D + x] * fx;
    L[m * D + x] = KQ[(c + a) * D + x] * fx;
  }
}

// A chunk's forward quantities, in per-thread buffers.
template <typename Acc>
struct KdaTerms {
  Acc* KQ;       // [K̂; Q̂] (2c×D)
  Acc* rn;       // their inverse norms (2c; l2norm only)
  double* b;     // cumulative sums of the clamped gates (c×D)
  Acc* eb;       // e^b, e^{b_c − b}, f, 1/f (4 × c×D)
  Acc* KQb;      // [K̂ ⊙ e^b; Q̂ ⊙ e^b] (2c×D)
  Acc* Kl;       // K̂ ⊙ e^{b_c − b} (c×D)
  Acc* elast;    // e^{b_c} (D)
  int* starts;   // the row blocks (c + 1)
  Acc* AP;       // [A; P] (2c×c): A_ij = β_i KK_ij below the diagonal, P_ij on and below, 0 above
  Acc* kkg;      // KK_ij below the diagonal (c×c; backward only)
  Acc* X;        // V − K̂_b S (c×E; backward only)
  Acc* Vp;       // V' (c×E)
  int nb = 1;    // number of row blocks
  Acc* el(int c, int64_t D) const { return eb + int64_t(c) * D; }
  Acc* f(int c, int64_t D) const { return eb + 2 * int64_t(c) * D; }
  Acc* fi(int c, int64_t D) const { return eb + 3 * int64_t(c) * D; }
};

// Work buffers for one block's factors and their gradients (any thread's chunk)
template <typename Acc>
struct FactorBuffers {
  Aligned<Acc> L, R, H, edge;
  FactorBuffers(int64_t chunk, int64_t D) : L(2 * chunk * D), R(chunk * D), H(chunk * D), edge(2 * D) {}
};

// The scores of a chunk into ch.AP (and ch.kkg when given), block by block (file comment)
template <typename Acc>
void chunk_scores(KdaTerms<Acc>& ch, const Acc* beta, int c, int64_t D, FactorBuffers<Acc>& w) {
  const int d = static_cast<int>(D);
  for (int k = 0; k < ch.nb; ++k) {
    const int a = ch.starts[k], z = ch.starts[k + 1], m = z - a;
    if (ch.nb == 1) {  // L and R from chunk_factors
      gemm_rm<Acc>(false, true, 2 * c, c, d, w.L.data(), d, w.R.data(), d, Acc(0), ch.AP, c);
    } else {
      left_factors(ch.KQ, ch.f(c, D), c, a, z, D, w.L.data());
      right_factors(ch.KQ, ch.b, ch.fi(c, D), a, z, D, w.R.data(), w.H.data());
      gemm_rm<Acc>(false, true, m, z, d, w.L.data(), d, w.R.data(), d, Acc(0), ch.AP + int64_t(a) * c, c);
      gemm_rm<Acc>(false, true, m, z, d, w.L.data() + m * D, d, w.R.data(), d, Acc(0), ch.AP + int64_t(c + a) * c, c);
    }
  }
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ Ai = ch.AP + int64_t(i) * c;
    Acc* __restrict__ Pi = ch.AP + int64_t(c + i) * c;
    if (ch.kkg != nullptr) std::copy(Ai, Ai + i, ch.kkg + int64_t(i) * c);
    const Acc bi = beta[i];
#pragma omp simd
    for (int j = 0; j < i; ++j) Ai[j] *= bi;
    for (int j = i + 1; j < c; ++j) Pi[j] = Acc(0);
  }
}

// The first half of a chunk's forward from the state S entering it: K̂, Q̂, gates, row blocks, A, P,
// then SK = K̂_b S, QS = alpha · Q̂_b S (front_products; QS = nullptr: not formed) and V'. Tokens
// [t0, t0 + c) of the row. The forward (QS given) leaves the chunk's gate factors e^b, e^{b_c − b}, f,
// 1/f unwritten where chunk_factors may (one row block); the backward reads them. Returns whether the
// chunk's gates are all finite and ≤ 0 (channel_gates).
template <typename T, typename Acc>
bool kda_front(const Row<T, Acc>& in, int64_t t0, int c, int64_t D, int64_t E, bool l2norm, const Acc* S,
               KdaTerms<Acc>& ch, Acc* SK, FactorBuffers<Acc>& w, Acc* QS, Acc alpha = Acc(1)) {
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  const int64_t cD = int64_t(c) * D;
  load_rows(in.k + t0 * D, ch.KQ, ch.rn, c, D, l2norm);
  load_rows(in.q + t0 * D, ch.KQ + cD, ch.rn + c, c, D, l2norm);
  const bool valid = channel_gates(in.g + t0 * D, c, D, ch.b, ch.elast);
  ch.nb = row_blocks(ch.b, c, D, ch.starts);
  const bool one = ch.nb == 1;  // then the scores' factors come with the rest
  chunk_factors(ch.b, ch.starts, ch.nb, ch.KQ, c, D, ch.eb, ch.el(c, D), ch.f(c, D), ch.fi(c, D), ch.KQb, ch.Kl,
                one ? w.L.data() : nullptr, one ? w.R.data() : nullptr, w.edge.data(), QS == nullptr);
  const Acc* beta = in.beta + t0;
  chunk_scores(ch, beta, c, D, w);
  front_products(ch.KQb, S, c, d, e, SK, QS, alpha);
  corrected_values(in.v + t0 * E, SK, static_cast<const Acc*>(nullptr), beta, ch.X, ch.Vp, c, E);
  solve_strips<Acc>(false, c, E, ch.AP, ch.Vp);
  return valid;
}

// S' = Diag(e^{b_c}) S + K̂_lᵀ V' (in place when S' == S)
template <typename Acc>
void kda_update_state(const Acc* S, Acc* S_next, const KdaTerms<Acc>& ch, int c, int64_t D, int64_t E) {
  scale_rows(S, ch.elast, S_next, static_cast<int>(D), E);
  gemm_rm<Acc>(true, false, static_cast<int>(D), static_cast<int>(E), c, ch.Kl, static_cast<int>(D), ch.Vp,
               static_cast<int>(E), Acc(1), S_next, static_cast<int>(E));
}

// Per-chunk buffers of `per` chunks (the forward: one; the backward: a saved block's chunks)
template <typename Acc>
struct TermBuffers {
  int64_t chunk, D, E;
  Aligned<Acc> KQ, rn, eb, KQb, Kl, elast, AP, kkg, X, Vp, S;
  Aligned<double> b;
  Aligned<int> starts, nbs;  // the row blocks of each chunk and their number
  TermBuffers(int64_t chunk_, int64_t D_, int64_t E_, int64_t per, bool backward)
      : chunk(chunk_), D(D_), E(E_), KQ(per * 2 * chunk * D), rn(per * 2 * chunk), eb(per * 4 * chunk * D),
        KQb(per * 2 * chunk * D), Kl(per * chunk * D), elast(per * D), AP(per * 2 * chunk * chunk),
        kkg(backward ? per * chunk * chunk : 0), X(backward ? per * chunk * E : 0), Vp(per * chunk * E),
        S(backward ? per * D * E : 0), b(per * chunk * D), starts(per * (chunk + 1)), nbs(per) {}
  KdaTerms<Acc> terms(int64_t j) {
    const int64_t cD = chunk * D;
    return {KQ.data() + j * 2 * cD, rn.data() + j * 2 * chunk, b.data() + j * cD, eb.data() + j * 4 * cD,
            KQb.data() + j * 2 * cD, Kl.data() + j * cD, elast.data() + j * D, starts.data() + j * (chunk + 1),
            AP.data() + j * 2 * chunk * chunk, kkg.data() == nullptr ? nullptr : kkg.data() + j * chunk * chunk,
            X.data() == nullptr ? nullptr : X.data() + j * chunk * E, Vp.data() + j * chunk * E};
  }
  Acc* state(int64_t j) { return S.data() + j * D * E; }
};

template <typename T>
void forward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& beta, const at::Tensor& g, at::Tensor& o, at::Tensor& S_all, at::Tensor* S_blocks,
                  double scale, bool l2norm, int64_t chunk) {
  using Acc = linattn_acc<T>;
  const int64_t D = q.size(3), E = v.size(3);
  const RowInputs<T, Acc> x(q, k, v, beta, &g, D);
  T* po = o.data_ptr<T>();
  Acc* pS = S_all.data_ptr<Acc>();
  Acc* pSb = S_blocks != nullptr ? S_blocks->data_ptr<Acc>() : nullptr;
  const Acc s = static_cast<Acc>(scale);
  std::atomic<bool> all_valid{true};
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    bool valid = true;
    TermBuffers<Acc> buf(chunk, D, E, 1, false);
    FactorBuffers<Acc> w(chunk, D);
    Aligned<Acc> SK(2 * chunk * E);
    for (int64_t i = i0; i < i1; ++i) {
      row_forward(
          rows, rows.row(i), x, pS, pSb, chunk, [&](const Row<T, Acc>& in, Acc* S, int64_t t0, int c, int64_t tok) {
            KdaTerms<Acc> ch = buf.terms(0);
            // O = s (Q̂_b S + P V'), formed in o itself for fp32 / fp64 (no copy out)
            Acc* O = direct_output<T, Acc>(po + tok * E, SK.data() + c * E);
            valid = kda_front(in, t0, c, D, E, l2norm, S, ch, SK.data(), w, O, s) && valid;
            gemm_rm<Acc>(false, false, c, static_cast<int>(E), c, ch.AP + c * c, c, ch.Vp, static_cast<int>(E), Acc(1),
                         O, static_cast<int>(E), s);
            if constexpr (!std::is_same<T, Acc>::value) narrow_bf16(O, po + tok * E, int64_t(c) * E);
            kda_update_state(S, S, ch, c, D, E);
          });
    }
    if (!valid) all_valid = false;
  });
  if (!all_valid) raise_invalid_gate(g, "g must be a finite log-decay ≤ 0 (α = e^g in (0, 1]), got ");
}

// One thread's work buffers for a chunk's backward
template <typename Acc>
struct GradBuffers {
  Aligned<Acc> SK, ZG, DPA, dL, dR, dK, dQ, db, tmp, dX;
  FactorBuffers<Acc> f;
  GradBuffers(int64_t chunk, int64_t D, int64_t E)
      : SK(2 * chunk * E), ZG(2 * chunk * E), DPA(2 * chunk * chunk), dL(2 * chunk * D), dR(chunk * D),
        dK(chunk * D), dQ(chunk * D), db(chunk * D), tmp(chunk * D), dX(chunk * E), f(chunk, D) {}
};

// One row block's share of the scores' gradients (score_grads), its rows from aD on (mD values) and the
// earlier columns (aD values): dK̂ += dL_k ⊙ f + dR ⊙ H, dQ̂ += dL_q ⊙ f, db += L_k ⊙ dL_k + L_q ⊙ dL_q
// − R ⊙ dR on the rows, dK̂ += dR ⊙ H, db −= R ⊙ dR on the earlier columns
template <typename Acc>
LINATTN_CLONES void block_grads(const Acc* __restrict__ L, const Acc* __restrict__ dL, const Acc* __restrict__ R,
                                const Acc* __restrict__ dR, const Acc* __restrict__ H, const Acc* __restrict__ f,
                                int64_t aD, int64_t mD, Acc* __restrict__ dK, Acc* __restrict__ dQ,
                                Acc* __restrict__ db) {
#pragma omp simd
  for (int64_t x = 0; x < aD; ++x) {
    dK[x] += dR[x] * H[x];
    db[x] -= R[x] * dR[x];
  }
#pragma omp simd
  for (int64_t x = 0; x < mD; ++x) {
    const int64_t y = aD + x;
    dK[y] += dL[x] * f[y] + dR[y] * H[y];
    dQ[y] += dL[mD + x] * f[y];
    db[y] += L[x] * dL[x] + L[mD + x] * dL[mD + x] - R[y] * dR[y];
  }
}

// The scores' part of the gradients of K̂, Q̂ and b, from dS = [dKK; dP] (2c×c, 0 above the diagonal):
// block by block, dL = dS_block R and dR = dS_blockᵀ L (the block's factors recomputed), then
// dK̂_i += dL_i ⊙ f_i, dQ̂_i += dL_i ⊙ f_i, db_i += L_i ⊙ dL_i (rows of the block), dK̂_j += dR_j ⊙ H_j,
// db_j −= R_j ⊙ dR_j (its columns); the reference row's terms cancel.
template <typename Acc>
void score_grads(const KdaTerms<Acc>& ch, const Acc* dS, int c, int64_t D, GradBuffers<Acc>& w) {
  const int d = static_cast<int>(D);
  Acc *dK = w.dK.data(), *dQ = w.dQ.data(), *db = w.db.data(), *dL = w.dL.data(), *dR = w.dR.data();
  Acc *L = w.f.L.data(), *R = w.f.R.data(), *H = w.f.H.data();
  const Acc* f = ch.f(c, D);
  for (int k = 0; k < ch.nb; ++k) {
    const int a = ch.starts[k], z = ch.starts[k + 1], m = z - a;
    const int64_t mD = int64_t(m) * D, aD = int64_t(a) * D;
    left_factors(ch.KQ, f, c, a, z, D, L);
    right_factors(ch.KQ, ch.b, ch.fi(c, D), a, z, D, R, H);
    if (ch.nb == 1) {
      gemm_rm<Acc>(false, false, 2 * c, d, c, dS, c, R, d, Acc(0), dL, d);
      gemm_rm<Acc>(true, false, c, d, 2 * c, dS, c, L, d, Acc(0), dR, d);
    } else {
      const Acc *top = dS + int64_t(a) * c, *bottom = dS + int64_t(c + a) * c;
      gemm_rm<Acc>(false, false, m, d, z, top, c, R, d, Acc(0), dL, d);
      gemm_rm<Acc>(false, false, m, d, z, bottom, c, R, d, Acc(0), dL + mD, d);
      gemm_rm<Acc>(true, false, z, d, m, top, c, L, d, Acc(0), dR, d);
      gemm_rm<Acc>(true, false, z, d, m, bottom, c, L + mD, d, Acc(1), dR, d);
    }
    block_grads(L, dL, R, dR, H, f, aD, mD, dK, dQ, db);
  }
}

// The gradients through the decayed copies of K̂ and Q̂, written into dK̂, dQ̂ and db: with Y = [Y_k; Y_q]
// (2c×D) the cotangents of K̂_b = K̂ ⊙ e^b and Q̂_b, Yl (c×D) that of K̂_l = K̂ ⊙ e^{b_c − b}, row by row
// dK̂ = Y_k ⊙ e^b + Yl ⊙ e^{b_c − b}, dQ̂ = Y_q ⊙ e^b, db = Y_k ⊙ K̂_b + Y_q ⊙ Q̂_b − Yl ⊙ K̂_l, and
// db_c += Σ_i Yl_i ⊙ K̂_l,i; on the last row the two K̂_l terms cancel (K̂_l,c = K̂_c) and are left out.
template <typename Acc>
LINATTN_CLONES void decay_grads(const Acc* __restrict__ Y, const Acc* __restrict__ Yl, const Acc* __restrict__ KQb,
                                const Acc* __restrict__ eb, const Acc* __restrict__ el, const Acc* __restrict__ Kl,
                                int c, int64_t D, Acc* __restrict__ dK, Acc* __restrict__ dQ, Acc* db) {
  const int64_t cD = int64_t(c) * D;
  Acc* __restrict__ last = db + cD - D;
  std::fill(last, last + D, Acc(0));
  for (int64_t i = 0; i < c; ++i) {
    const int64_t o = i * D;
    Acc* __restrict__ dbi = db + o;
    if (i + 1 < c) {
#pragma omp simd
      for (int64_t x = 0; x < D; ++x) {
        const Acc yl = Yl[o + x], kl = Kl[o + x];
        dbi[x] = Y[o + x] * KQb[o + x] + Y[cD + o + x] * KQb[cD + o + x] - yl * kl;
        last[x] += yl * kl;
      }
    } else {
#pragma omp simd
      for (int64_t x = 0; x < D; ++x) last[x] += Y[o + x] * KQb[o + x] + Y[cD + o + x] * KQb[cD + o + x];
    }
#pragma omp simd
    for (int64_t x = 0; x < D; ++x) {
      dK[o + x] = Y[o + x] * eb[o + x] + Yl[o + x] * el[o + x];
      dQ[o + x] = Y[cD + o + x] * eb[o + x];
    }
  }
}

// From DPA = [Z V'ᵀ; dO' V'ᵀ] (2c×c) in place: the top becomes dKK = diag(β) dA with dA = −strict_tril(Z V'ᵀ)
// (0 on and above the diagonal), the bottom dP = tril(dO' V'ᵀ); dβ_i += Σ_j dA_ij KK_ij.
template <typename Acc>
LINATTN_CLONES void score_cotangents(Acc* __restrict__ DPA, const Acc* __restrict__ kkg, const Acc* __restrict__ beta,
                                     Acc* __restrict__ dbeta, int c) {
  for (int i = 0; i < c; ++i)
    dbeta[i] += ungated_cotangent_row(DPA + int64_t(i) * c, DPA + int64_t(c + i) * c, kkg + int64_t(i) * c, beta[i], i, c);
}

// The backward of one chunk (tokens [t0, t0 + c)): its terms ch and entering state S, R = ∂L/∂S after
// it (updated to ∂L/∂S before it). The output gradient is taken as dO' = scale · dO.
template <typename T, typename Acc>
void kda_chunk_backward(const Row<T, Acc>& in, const RowGrads<T, Acc>& out, int64_t t0, int c, int64_t D, int64_t E,
                        bool l2norm, Acc scale, const KdaTerms<Acc>& ch, const Acc* S, Acc* R, GradBuffers<Acc>& w) {
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  const int64_t cD = int64_t(c) * D, cE = int64_t(c) * E;
  const Acc* beta = in.beta + t0;
  const Acc *Kh = ch.KQ, *Qh = ch.KQ + cD, *A = ch.AP, *P = ch.AP + c * c, *eb = ch.eb, *el = ch.el(c, D);
  Acc *Z = w.ZG.data(), *G = w.ZG.data() + cE, *dX = w.dX.data(), *tmp = w.tmp.data();
  Acc *dK = w.dK.data(), *dQ = w.dQ.data(), *db = w.db.data();
  Acc* dbeta = out.dbeta + t0;
  load_rows<T, Acc>(out.dO + t0 * E, G, nullptr, c, E, false);
  if (scale != Acc(1)) scale_all(G, scale, cE);
  // Z = (I + A)⁻ᵀ dV',  dV' = K̂_l R + Pᵀ dO'
  gemm_rm<Acc>(false, false, c, e, d, ch.Kl, d, R, e, Acc(0), Z, e);
  gemm_rm<Acc>(true, false, c, e, c, P, c, G, e, Acc(1), Z, e);
  solve_strips<Acc>(true, c, E, A, Z);
  // dV = dX = diag(β) Z, dβ = rowsum(Z ⊙ X) + Σ_j dA_ij KK_ij
  scale_rows(Z, beta, dX, c, E);
  store_scaled<T, Acc>(dX, Acc(1), out.dv + t0 * E, cE);
  std::fill(dbeta, dbeta + c, Acc(0));
  add_row_dots<Acc>(Z, ch.X, nullptr, Acc(1), dbeta, c, E);
  gemm_rm<Acc>(false, true, 2 * c, c, e, w.ZG.data(), e, ch.Vp, e, Acc(0), w.DPA.data(), c);
  score_cotangents(w.DPA.data(), ch.kkg, beta, dbeta, c);
  // K̂_b in X, Q̂_b in O: [dK̂_b; dQ̂_b] = [−dX; dO'] Sᵀ (ZG holds [−dX; dO'] from here on);
  // K̂_l in the state: dK̂_l = V' Rᵀ. They start dK̂, dQ̂ and db, which the scores add to.
  for (int64_t x = 0; x < cE; ++x) Z[x] = -dX[x];
  gemm_rm<Acc>(false, true, 2 * c, d, e, w.ZG.data(), e, S, e, Acc(0), w.dL.data(), d);
  gemm_rm<Acc>(false, true, c, d, e, ch.Vp, e, R, e, Acc(0), tmp, d);
  decay_grads(w.dL.data(), tmp, ch.KQb, eb, el, ch.Kl, c, D, dK, dQ, db);
  score_grads(ch, w.DPA.data(), c, D, w);
  Acc* db_last = db + cD - D;
  for (int64_t x = 0; x < D; ++x) {  // Diag(e^{b_c}) S: e^{b_c} Σ_e S_de R_de into b_c
    Acc sr = 0;
#pragma omp simd reduction(+ : sr)
    for (int64_t y = 0; y < E; ++y) sr += S[x * E + y] * R[x * E + y];
    db_last[x] += ch.elast[x] * sr;
  }
  // ∂L/∂g_s = Σ_{t ≥ s} ∂L/∂b_t in the chunk, per channel (0 for a g below the floor)
  const Acc* g = in.g + t0 * D;
  Acc* dg = out.dg + t0 * D;
  Acc* __restrict__ run = tmp;
  std::fill(run, run + D, Acc(0));
  for (int i = c - 1; i >= 0; --i) {
    const Acc* __restrict__ di = db + int64_t(i) * D;
    const Acc* __restrict__ gi = g + int64_t(i) * D;
    Acc* __restrict__ dgi = dg + int64_t(i) * D;
#pragma omp simd
    for (int64_t x = 0; x < D; ++x) {
      run[x] += di[x];
      dgi[x] = static_cast<double>(gi[x]) < kChannelFloor ? Acc(0) : run[x];
    }
  }
  // R ← Diag(e^{b_c}) R + [K̂_b; Q̂_b]ᵀ [−dX; dO']
  scale_rows(R, ch.elast, R, d, E);
  gemm_rm<Acc>(true, false, d, e, 2 * c, ch.KQb, d, w.ZG.data(), e, Acc(1), R, e);
  chain_rows(dQ, Qh, ch.rn + c, l2norm, out.dq + t0 * D, c, D);
  chain_rows(dK, Kh, ch.rn, l2norm, out.dk + t0 * D, c, D);
}

template <typename T>
void backward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& beta, const at::Tensor& g, const at::Tensor& S_blocks, const at::Tensor& dO,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dbeta, at::Tensor& dg, at::Tensor& R_all,
                   double scale, bool l2norm, int64_t chunk) {
  using Acc = linattn_acc<T>;
  const int64_t D = q.size(3), E = v.size(3), block = block_tokens(chunk), per = block / chunk;
  const RowInputs<T, Acc> x(q, k, v, beta, &g, D);
  const RowGradOutputs<T, Acc> dx(dO, dq, dk, dv, dbeta, &dg, D);
  const Acc* pSb = S_blocks.data_ptr<Acc>();
  Acc* pR = R_all.data_ptr<Acc>();
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    TermBuffers<Acc> terms(chunk, D, E, per, true);
    GradBuffers<Acc> w(chunk, D, E);
    for (int64_t i = i0; i < i1; ++i) {
      row_backward(
          rows, rows.row(i), x, dx, pSb, pR, chunk, terms.state(0),
          [&](const Row<T, Acc>& in, int64_t j, int64_t t0, int c, bool more) {  // the block's chunks again
            KdaTerms<Acc> ch = terms.terms(j);
            kda_front(in, t0, c, D, E, l2norm, terms.state(j), ch, w.SK.data(), w.f, static_cast<Acc*>(nullptr));
            terms.nbs.data()[j] = ch.nb;
            if (more) kda_update_state(terms.state(j), terms.state(j + 1), ch, c, D, E);
          },
          [&](const Row<T, Acc>& in, const RowGrads<T, Acc>& out, Acc* R, int64_t j, int64_t t0, int c) {
            KdaTerms<Acc> ch = terms.terms(j);
            ch.nb = terms.nbs.data()[j];
            kda_chunk_backward(in, out, t0, c, D, E, l2norm, static_cast<Acc>(scale), ch, terms.state(j), R, w);
          });
    }
  });
}

// Returns (o, S, S_blocks); S_blocks (the saved blocks of every row, D, E) is empty unless save (training).
std::tuple<at::Tensor, at::Tensor, at::Tensor> kda_chunked(const at::Tensor& q_in, const at::Tensor& k_in,
                                                           const at::Tensor& v_in, const at::Tensor& beta_in,
                                                           const at::Tensor& g_in, const at::Tensor& S0, double scale,
                                                           bool l2norm, int64_t chunk, bool save,
                                                           const c10::optional<at::Tensor>& cu_seqlens) {
  const Rows rows = check_inputs("linattn_cpu::kda_chunked", q_in, k_in, v_in, beta_in, &g_in, true, S0, false, chunk,
                                 cu_seqlens, "the state must be (B, H, D, E) (S for B with cu_seqlens)");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), beta = beta_in.contiguous();
  const at::Tensor g = g_in.contiguous();
  const int64_t D = q.size(3), E = v.size(3);
  at::Tensor S = S0.contiguous().clone().view({rows.sequences(), q.size(1), D, E});
  at::Tensor o = empty_result(v.sizes(), v.options());
  at::Tensor S_blocks = at::empty({save ? rows.blocks() : 0, D, E}, S.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_kda_chunked", [&] {
    forward_rows<scalar_t>(rows, q, k, v, beta, g, o, S, save ? &S_blocks : nullptr, scale, l2norm, chunk);
  });
  return {o, S, S_blocks};
}

// Returns (dq, dk, dv, dbeta, dg, dS0). dS: ∂L/∂S of the final state or None.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> kda_chunked_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& beta_in,
    const at::Tensor& g_in, const at::Tensor& S_blocks_in, const at::Tensor& do_in, const c10::optional<at::Tensor>& dS,
    double scale, bool l2norm, int64_t chunk,
    const c10::optional<at::Tensor>& cu_seqlens) {
  const char* op = "linattn_cpu::kda_chunked_backward";
  const Rows rows = check_inputs(op, q_in, k_in, v_in, beta_in, &g_in, true, S_blocks_in, true, chunk, cu_seqlens,
                                 "the saved block states do not match q, k, v");
  BackwardTensors t(op, rows, q_in, k_in, v_in, beta_in, S_blocks_in, do_in, dS);
  const at::Tensor g = g_in.contiguous();
  at::Tensor dg = empty_result(g.sizes(), t.S_blocks.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, t.q.scalar_type(), "linattn_cpu_kda_chunked_backward", [&] {
    backward_rows<scalar_t>(rows, t.q, t.k, t.v, t.beta, g, t.S_blocks, t.dO, t.dq, t.dk, t.dv, t.dbeta, dg, t.R, scale,
                            l2norm, chunk);
  });
  return {t.dq, t.dk, t.dv, t.dbeta, dg, t.initial_state_grad(rows)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def(
      "kda_chunked(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, Tensor S0, float scale, bool l2norm, "
      "int chunk, bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "kda_chunked_backward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor g, Tensor S_blocks, Tensor do, "
      "Tensor? dS, float scale, bool l2norm, int chunk, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("kda_chunked", kda_chunked);
  m.impl("kda_chunked_backward", kda_chunked_backward);
}
