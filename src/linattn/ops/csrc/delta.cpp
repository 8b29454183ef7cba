// Fused CPU operators for the delta rule (design §13; linattn.ops.delta), per (batch, head) row:
//
//   S_t = α_t (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ,   o_t = scale · S_tᵀ q̂_t,   α_t = e^{g_t}
//
// with q̂, k̂ the L2-normalized q, k (l2norm) or q, k themselves. `delta_chunked` runs a row chunk by
// chunk in the WY/UT form of linattn/ops/delta/chunked.py: per chunk of c tokens, with b the
// cumulative sum of g in the chunk and Γ_ij = e^{b_i − b_j} (i ≥ j),
//
//   [K̂; Q̂] K̂ᵀ  -> A = strict_tril(diag(β) K̂K̂ᵀ ⊙ Γ), P = tril(Q̂K̂ᵀ ⊙ Γ)         (one gemm, 2c×D×c)
//   [K̂; Q̂] S   -> X = V − diag(e^b) K̂S,  V' = (I + A)⁻¹ diag(β) X             (one gemm, one solve)
//   O = diag(e^b) Q̂S + P V',   S ← e^{b_c} S + K̂ᵀ diag(e^{b_c − b}) V'
//
// all in Acc (float for fp32 and bf16 inputs, double for fp64): bf16 rows are widened as they are
// read, so the gemms, the triangular solves and the state are fp32. The training forward also saves
// the state entering every block of kBlock tokens; `delta_chunked_backward` walks each row's blocks in
// reverse, recomputes a block's chunks from its saved state (keeping their K̂, Q̂, A, P, Γ, K̂K̂ᵀ ⊙ Γ,
// S, X, V' in per-thread buffers), then runs the chunks' backward in reverse (formulas in chunked.py),
// carrying ∂L/∂S from chunk to chunk. `delta_step`
// is one token of the recurrence for decoding, with g one decay per row or one per key channel (KDA:
// S' = (I − β k̂k̂ᵀ) Diag(e^g) S + β k̂ vᵀ); the chunked kernels here take one per row (a per-channel g
// runs kda.cpp's). β and g come in Acc, checked here only by `delta_step` (linattn checks them before
// the chunked ops). The pieces shared with kda.cpp are in delta.h. The chunked kernels take packed
// sequences (cu_seqlens: one row per sequence and head, from its own initial state; rows.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "blas.h"
#include "common.h"
#include "delta.h"
#include "pool.h"
#include "rows.h"
#include "step_rows.h"

namespace {

using linattn_pool::empty_result;


// Each g is clamped at this floor before b is summed (GATE_FLOOR of linattn/ops/delta/chunked.py):
// e^{−100} ≈ 3.7e-44 forgets as completely as any stronger gate, and b stays small enough for double.
constexpr double kGateFloor = -100.0;

// b = the inclusive cumulative sum of the chunk's max(g, kGateFloor), in double (after one strong gate
// the differences b_i − b_j of an Acc sum would lose the small gates: design §13), e^b and e^{b_c − b};
// returns e^{b_c}
template <typename Acc>
LINATTN_CLONES Acc chunk_gates(const Acc* __restrict__ g, int c, double* __restrict__ b, Acc* __restrict__ eb,
                               Acc* __restrict__ el) {
  double run = 0;
  for (int i = 0; i < c; ++i) b[i] = run += std::max(static_cast<double>(g[i]), kGateFloor);
  const double last = b[c - 1];
  for (int i = 0; i < c; ++i) {
    eb[i] = static_cast<Acc>(b[i]);
    el[i] = static_cast<Acc>(last - b[i]);
  }
#pragma omp simd
  for (int i = 0; i < c; ++i) {
    eb[i] = exp_nonpositive(eb[i]);
    el[i] = exp_nonpositive(el[i]);
  }
  return exp_nonpositive(static_cast<Acc>(last));
}

// From [K̂K̂ᵀ; Q̂K̂ᵀ] (2c×c, row-major) in place: the top becomes A_ij = β_i (K̂K̂ᵀ ⊙ Γ)_ij strictly below
// the diagonal (the diagonal and the upper part are left as they are: the solves do not read them),
// the bottom P_ij = (Q̂K̂ᵀ ⊙ Γ)_ij on and below the diagonal and 0 above. With b (gated) Γ_ij =
// e^{b_i − b_j}, kept in gam when given (else in the c-long row); without, Γ = 1. kkg (when given)
// gets (K̂K̂ᵀ ⊙ Γ)_ij below the diagonal, for the backward's dβ.
template <typename Acc>
LINATTN_CLONES void build_scores(Acc* __restrict__ M, int c, const Acc* __restrict__ beta, const double* __restrict__ b,
                                 Acc* __restrict__ gam, Acc* __restrict__ kkg, Acc* __restrict__ row) {
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ Ai = M + int64_t(i) * c;
    Acc* __restrict__ Pi = M + int64_t(c + i) * c;
    Acc* __restrict__ Ki = kkg != nullptr ? kkg + int64_t(i) * c : nullptr;
    const Acc bi = beta[i];
    if (b != nullptr) {
      Acc* __restrict__ G = gam != nullptr ? gam + int64_t(i) * c : row;
      const double top = b[i];
      for (int j = 0; j <= i; ++j) G[j] = static_cast<Acc>(top - b[j]);  // the difference in double
#pragma omp simd
      for (int j = 0; j <= i; ++j) G[j] = exp_nonpositive(G[j]);
      if (kkg != nullptr) {
#pragma omp simd
        for (int j = 0; j < i; ++j) Ki[j] = Ai[j] * G[j];
      }
#pragma omp simd
      for (int j = 0; j < i; ++j) Ai[j] *= bi * G[j];
#pragma omp simd
      for (int j = 0; j <= i; ++j) Pi[j] *= G[j];
    } else {
      if (kkg != nullptr) std::copy(Ai, Ai + i, Ki);
#pragma omp simd
      for (int j = 0; j < i; ++j) Ai[j] *= bi;
    }
    for (int j = i + 1; j < c; ++j) Pi[j] = Acc(0);
  }
}

// A chunk's forward quantities, in per-thread buffers.
template <typename Acc>
struct ChunkTerms {
  Acc* KQ;   // [K̂; Q̂] (2c×D)
  Acc* rn;   // their inverse norms (2c; l2norm only)
  double* b; // b, the cumulative sum of the clamped gates (c; gated only)
  Acc* eb;   // e^b, e^{b_c − b} (2c; gated only)
  Acc* AP;   // [A; P] (2c×c, see build_scores)
  Acc* gam;  // Γ (c×c; gated backward only)
  Acc* kkg;  // K̂K̂ᵀ ⊙ Γ below the diagonal (c×c; backward only)
  Acc* X;    // V − diag(e^b) K̂S (c×E; backward only)
  Acc* Vp;   // V' (c×E)
  Acc elast; // e^{b_c}
};

// The first half of a chunk's forward from the state S entering it: K̂, Q̂, gates, A, P, then
// SK = K̂ S, QS = alpha · Q̂ S (QS = nullptr: not formed; QS = SK + c·E: one stacked gemm) and V'.
// Tokens [t0, t0 + c) of the row.
template <typename T, typename Acc>
void chunk_front(const Row<T, Acc>& in, int64_t t0, int c, int64_t D, int64_t E, bool l2norm, const Acc* S,
                 ChunkTerms<Acc>& ch, Acc* SK, Acc* row, Acc* QS, Acc alpha = Acc(1)) {
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  load_rows(in.k + t0 * D, ch.KQ, ch.rn, c, D, l2norm);
  load_rows(in.q + t0 * D, ch.KQ + c * D, ch.rn + c, c, D, l2norm);
  const Acc* beta = in.beta + t0;
  const Acc* eb = nullptr;
  ch.elast = Acc(1);
  if (in.g != nullptr) {
    ch.elast = chunk_gates(in.g + t0, c, ch.b, ch.eb, ch.eb + c);
    eb = ch.eb;
  }
  gemm_rm<Acc>(false, true, 2 * c, c, d, ch.KQ, d, ch.KQ, d, Acc(0), ch.AP, c);
  build_scores(ch.AP, c, beta, in.g != nullptr ? ch.b : nullptr, ch.gam, ch.kkg, row);
  front_products(ch.KQ, S, c, d, e, SK, QS, alpha);
  corrected_values(in.v + t0 * E, SK, eb, beta, ch.X, ch.Vp, c, E);
  solve_strips<Acc>(false, c, E, ch.AP, ch.Vp);
}

// S ← e^{b_c} S + K̂ᵀ diag(e^{b_c − b}) V' (tmp: c×E, used when gated)
template <typename Acc>
void update_state(Acc* S, const ChunkTerms<Acc>& ch, bool gated, int c, int64_t D, int64_t E, Acc* tmp) {
  const int d = static_cast<int>(D), e = static_cast<int>(E);
  const Acc* Vp = ch.Vp;
  if (gated) {
    scale_all(S, ch.elast, D * E);
    scale_rows(ch.Vp, ch.eb + c, tmp, c, E);
    Vp = tmp;
  }
  gemm_rm<Acc>(true, false, d, e, c, ch.KQ, d, Vp, e, Acc(1), S, e);
}

// Work buffers of one thread for the forward: one chunk's terms
template <typename Acc>
struct FrontBuffers {
  Aligned<Acc> KQ, rn, eb, AP, Vp, SK, row;
  Aligned<double> b;
  FrontBuffers(int64_t chunk, int64_t D, int64_t E)
      : KQ(2 * chunk * D), rn(2 * chunk), eb(2 * chunk), AP(2 * chunk * chunk), Vp(chunk * E), SK(2 * chunk * E),
        row(chunk), b(chunk) {}
  ChunkTerms<Acc> terms() {
    return {KQ.data(), rn.data(), b.data(), eb.data(), AP.data(), nullptr, nullptr, nullptr, Vp.data(), Acc(1)};
  }
};

template <typename T>
void forward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& beta, const at::Tensor* g, at::Tensor& o, at::Tensor& S_all, at::Tensor* S_blocks,
                  double scale, bool l2norm, int64_t chunk) {
  using Acc = linattn_acc<T>;
  const int64_t D = q.size(3), E = v.size(3);
  const RowInputs<T, Acc> x(q, k, v, beta, g, 1);
  T* po = o.data_ptr<T>();
  Acc* pS = S_all.data_ptr<Acc>();
  Acc* pSb = S_blocks != nullptr ? S_blocks->data_ptr<Acc>() : nullptr;
  const bool gated = g != nullptr;
  const Acc s = static_cast<Acc>(scale);
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    FrontBuffers<Acc> buf(chunk, D, E);
    Aligned<Acc> tmp(gated ? chunk * E : 0);
    for (int64_t i = i0; i < i1; ++i) {
      row_forward(
          rows, rows.row(i), x, pS, pSb, chunk, [&](const Row<T, Acc>& in, Acc* S, int64_t t0, int c, int64_t tok) {
            ChunkTerms<Acc> ch = buf.terms();
            // O = s (diag(e^b) Q̂S + P V'), formed in o itself for fp32 / fp64 (no copy out)
            Acc* O = direct_output<T, Acc>(po + tok * E, buf.SK.data() + c * E);
            chunk_front(in, t0, c, D, E, l2norm, S, ch, buf.SK.data(), buf.row.data(), O, s);
            if (gated) scale_rows(O, ch.eb, O, c, E);
            gemm_rm<Acc>(false, false, c, static_cast<int>(E), c, ch.AP + c * c, c, ch.Vp, static_cast<int>(E), Acc(1),
                         O, static_cast<int>(E), s);
            if constexpr (!std::is_same<T, Acc>::value) narrow_bf16(O, po + tok * E, int64_t(c) * E);
            update_state(S, ch, gated, c, D, E, tmp.data());
          });
    }
  });
}

// The score gradients of a chunk, from DPA = [dO' V'ᵀ; Z V'ᵀ] (2c×c) in place, with P, K̂K̂ᵀ ⊙ Γ and Γ
// of the forward (gam = nullptr: no gate):
//   top:    dP ⊙ Γ on and below the diagonal, 0 above            (dP = tril(dO' V'ᵀ))
//   bottom: H = diag(β) dA ⊙ Γ strictly below the diagonal, 0 elsewhere   (dA = −strict_tril(Z V'ᵀ))
// dβ_i += Σ_j dA_ij (K̂K̂ᵀ ⊙ Γ)_ij; with a gate, the Γ terms of ∂L/∂b: G = dP ⊙ P + dA ⊙ A (A_ij =
// β_i (K̂K̂ᵀ ⊙ Γ)_ij), db_i += row sum − column sum (col: c work values). Then Nm (c×2c) =
// [H + Hᵀ, (dP ⊙ Γ)ᵀ], the left factor of dK̂ = Nm [K̂; Q̂].
template <typename Acc>
LINATTN_CLONES void score_grads(Acc* __restrict__ DPA, const Acc* __restrict__ P, const Acc* __restrict__ kkg,
                                const Acc* __restrict__ gam, const Acc* __restrict__ beta, Acc* __restrict__ dbeta,
                                Acc* __restrict__ db, Acc* __restrict__ col, Acc* __restrict__ Nm, int c) {
  Acc* __restrict__ dP = DPA;
  Acc* __restrict__ H = DPA + int64_t(c) * c;
  if (gam != nullptr) std::fill(col, col + c, Acc(0));
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ dPi = dP + int64_t(i) * c;
    Acc* __restrict__ Hi = H + int64_t(i) * c;
    const Acc* __restrict__ Ki = kkg + int64_t(i) * c;
    const Acc bi = beta[i];
    if (gam != nullptr) {
      const Acc* __restrict__ Pi = P + int64_t(i) * c;
      const Acc* __restrict__ Gi = gam + int64_t(i) * c;
      Acc sb = 0, rows = 0;
#pragma omp simd reduction(+ : sb, rows)
      for (int j = 0; j < i; ++j) {
        const Acc da = -Hi[j], t = da * Ki[j];
        sb += t;
        rows += bi * t;
        col[j] += bi * t;
        Hi[j] = da * bi * Gi[j];
      }
#pragma omp simd reduction(+ : rows)
      for (int j = 0; j <= i; ++j) {
        const Acc dp = dPi[j], t = dp * Pi[j];
        rows += t;
        col[j] += t;
        dPi[j] = dp * Gi[j];
      }
      db[i] += rows;
      dbeta[i] += sb;
      for (int j = i; j < c; ++j) Hi[j] = Acc(0);
      for (int j = i + 1; j < c; ++j) dPi[j] = Acc(0);
    } else {
      dbeta[i] += ungated_cotangent_row(Hi, dPi, Ki, bi, i, c);
    }
  }
  if (gam != nullptr) {
    for (int j = 0; j < c; ++j) db[j] -= col[j];
  }
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ Ni = Nm + int64_t(i) * 2 * c;
    for (int j = 0; j < c; ++j) {
      Ni[j] = H[int64_t(i) * c + j] + H[int64_t(j) * c + i];
      Ni[c + j] = dP[int64_t(j) * c + i];
    }
  }
}

// Work buffers of one thread for the backward: the terms and entering states of a block's chunks,
// and one chunk's gradient work.
template <typename Acc>
struct BackBuffers {
  int64_t chunk, D, E;
  Aligned<Acc> KQ, rn, eb, AP, gam, kkg, X, Vp, S;  // per chunk of the block
  Aligned<double> b;                                 // per chunk of the block
  Aligned<Acc> SK, row, tmp, GZ, DPA, Nm, dK, dQ, KR, work, dX, db;
  BackBuffers(int64_t chunk_, int64_t D_, int64_t E_, int64_t per, bool gated)
      : chunk(chunk_), D(D_), E(E_), KQ(per * 2 * chunk * D), rn(per * 2 * chunk), eb(per * 2 * chunk),
        AP(per * 2 * chunk * chunk), gam(gated ? per * chunk * chunk : 0), kkg(per * chunk * chunk), X(per * chunk * E),
        Vp(per * chunk * E),
        S(per * D * E), b(per * chunk), SK(chunk * E), row(chunk), tmp(chunk * E), GZ(2 * chunk * E),
        DPA(2 * chunk * chunk),
        Nm(2 * chunk * chunk), dK(chunk * D), dQ(chunk * D), KR(chunk * E), work(chunk * D), dX(chunk * E),
        db(chunk) {}
  ChunkTerms<Acc> terms(int64_t j, bool gated) {
    return {KQ.data() + j * 2 * chunk * D, rn.data() + j * 2 * chunk, b.data() + j * chunk,
            eb.data() + j * 2 * chunk, AP.data() + j * 2 * chunk * chunk, gated ? gam.data() + j * chunk * chunk : nullptr,
            kkg.data() + j * chunk * chunk, X.data() + j * chunk * E, Vp.data() + j * chunk * E, Acc(1)};
  }
  Acc* state(int64_t j) { return S.data() + j * D * E; }
};

// The backward of one chunk (tokens [t0, t0 + c)): its terms ch and entering state S from the
// forward, R = ∂L/∂S after it (updated to ∂L/∂S before it). Formulas in linattn/ops/delta/chunked.py;
// the output gradient is taken as dO' = scale · dO, the gradient of the unscaled O = S'ᵀ q̂.
template <typename T, typename Acc>
void chunk_backward(const Row<T, Acc>& in, const RowGrads<T, Acc>& out, int64_t t0, int c, bool l2norm, Acc scale,
                    const ChunkTerms<Acc>& ch, const Acc* S, Acc* R, BackBuffers<Acc>& w) {
  const int64_t D = w.D, E = w.E;
  const int d = static_cast<int>(D), e = static_cast<int>(E), c2 = 2 * c;
  const bool gated = in.g != nullptr;
  const Acc* beta = in.beta + t0;
  const Acc *eb = gated ? ch.eb : nullptr, *el = gated ? ch.eb + c : nullptr;
  const Acc *Kh = ch.KQ, *Qh = ch.KQ + c * D, *A = ch.AP, *P = ch.AP + c * c;
  Acc *G = w.GZ.data(), *Z = w.GZ.data() + c * E, *db = w.db.data();
  Acc* dbeta = out.dbeta + t0;
  load_rows<T, Acc>(out.dO + t0 * E, G, nullptr, c, E, false);
  if (scale != Acc(1)) scale_all(G, scale, int64_t(c) * E);
  // dV' = Pᵀ dO' + diag(e^{b_c − b}) K̂ R, solved in place into Z = (I + A)⁻ᵀ dV'
  if (gated) {
    gemm_rm<Acc>(false, false, c, e, d, Kh, d, R, e, Acc(0), w.KR.data(), e);
    scale_rows(w.KR.data(), el, Z, c, E);
  } else {
    gemm_rm<Acc>(false, false, c, e, d, Kh, d, R, e, Acc(0), Z, e);
  }
  gemm_rm<Acc>(true, false, c, e, c, P, c, G, e, Acc(1), Z, e);
  solve_strips<Acc>(true, c, E, A, Z);
  // dV = dX = diag(β) Z, dβ = rowsum(Z ⊙ X) + the A term (score_grads)
  scale_rows(Z, beta, w.dX.data(), c, E);
  store_scaled<T, Acc>(w.dX.data(), Acc(1), out.dv + t0 * E, int64_t(c) * E);
  for (int i = 0; i < c; ++i) dbeta[i] = Acc(0);
  add_row_dots<Acc>(Z, ch.X, nullptr, Acc(1), dbeta, c, E);
  std::fill(db, db + c, Acc(0));
  gemm_rm<Acc>(false, true, c2, c, e, G, e, ch.Vp, e, Acc(0), w.DPA.data(), c);
  score_grads(w.DPA.data(), P, ch.kkg, ch.gam, beta, dbeta, db, w.row.data(), w.Nm.data(), c);
  // dK̂ = [H + Hᵀ, (dP ⊙ Γ)ᵀ] [K̂; Q̂] − diag(e^b) dX Sᵀ + diag(e^{b_c − b}) V' Rᵀ,  dQ̂ = (dP ⊙ Γ) K̂ + diag(e^b) dO' Sᵀ
  Acc *dK = w.dK.data(), *dQ = w.dQ.data(), *tmp = w.work.data();
  gemm_rm<Acc>(false, false, c, d, c2, w.Nm.data(), c2, ch.KQ, d, Acc(0), dK, d);
  gemm_rm<Acc>(false, false, c, d, c, w.DPA.data(), c, Kh, d, Acc(0), dQ, d);
  if (!gated) {
    gemm_rm<Acc>(false, true, c, d, e, G, e, S, e, Acc(1), dQ, d);
    gemm_rm<Acc>(false, true, c, d, e, w.dX.data(), e, S, e, Acc(1), dK, d, Acc(-1));
    gemm_rm<Acc>(false, true, c, d, e, ch.Vp, e, R, e, Acc(1), dK, d);
  } else {
    gemm_rm<Acc>(false, true, c, d, e, G, e, S, e, Acc(0), tmp, d);
    add_scaled_rows(tmp, eb, Acc(1), dQ, c, D);
    add_row_dots(tmp, Qh, eb, Acc(1), db, c, D);
    gemm_rm<Acc>(false, true, c, d, e, w.dX.data(), e, S, e, Acc(0), tmp, d);
    add_scaled_rows(tmp, eb, Acc(-1), dK, c, D);
    add_row_dots(tmp, Kh, eb, Acc(-1), db, c, D);
    gemm_rm<Acc>(false, true, c, d, e, ch.Vp, e, R, e, Acc(0), tmp, d);
    add_scaled_rows(tmp, el, Acc(1), dK, c, D);
    std::fill(w.row.data(), w.row.data() + c, Acc(0));
    add_row_dots(tmp, Kh, el, Acc(1), w.row.data(), c, D);  // e^{b_c − b_i} K̂_i · (V' Rᵀ)_i
    Acc from_l = 0, sr = 0;
    for (int i = 0; i < c; ++i) {
      db[i] -= w.row.data()[i];
      from_l += w.row.data()[i];
    }
#pragma omp simd reduction(+ : sr)
    for (int64_t x = 0; x < D * E; ++x) sr += S[x] * R[x];
    db[c - 1] += from_l + ch.elast * sr;
    Acc run = 0;  // ∂L/∂g_s = Σ_{t ≥ s} ∂L/∂b_t in the chunk (0 for a g clamped at the floor)
    for (int i = c - 1; i >= 0; --i) {
      run += db[i];
      out.dg[t0 + i] = static_cast<double>(in.g[t0 + i]) < kGateFloor ? Acc(0) : run;
    }
  }
  // R ← e^{b_c} R + [K̂; Q̂]ᵀ [−diag(e^b) dX; diag(e^b) dO']
  if (gated) {
    scale_rows(G, eb, Z, c, E);
    scale_rows(w.dX.data(), eb, G, c, E);
    scale_all(R, ch.elast, D * E);
  } else {
    std::copy(G, G + c * E, Z);
    std::copy(w.dX.data(), w.dX.data() + c * E, G);
  }
  scale_all(G, Acc(-1), int64_t(c) * E);
  gemm_rm<Acc>(true, false, d, e, c2, ch.KQ, d, w.GZ.data(), e, Acc(1), R, e);
  chain_rows(dQ, Qh, ch.rn + c, l2norm, out.dq + t0 * D, c, D);
  chain_rows(dK, Kh, ch.rn, l2norm, out.dk + t0 * D, c, D);
}

template <typename T>
void backward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& beta, const at::Tensor* g, const at::Tensor& S_blocks, const at::Tensor& dO,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dbeta, at::Tensor* dg, at::Tensor& R_all,
                   double scale, bool l2norm, int64_t chunk) {
  using Acc = linattn_acc<T>;
  const int64_t D = q.size(3), E = v.size(3), block = block_tokens(chunk), per = block / chunk;
  const RowInputs<T, Acc> x(q, k, v, beta, g, 1);
  const RowGradOutputs<T, Acc> dx(dO, dq, dk, dv, dbeta, dg, 1);
  const Acc* pSb = S_blocks.data_ptr<Acc>();
  Acc* pR = R_all.data_ptr<Acc>();
  const bool gated = g != nullptr;
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    const FlushDenormals flush;
    BackBuffers<Acc> w(chunk, D, E, per, gated);
    for (int64_t i = i0; i < i1; ++i) {
      row_backward(
          rows, rows.row(i), x, dx, pSb, pR, chunk, w.state(0),
          [&](const Row<T, Acc>& in, int64_t j, int64_t t0, int c, bool more) {  // the block's chunks again
            ChunkTerms<Acc> ch = w.terms(j, gated);
            chunk_front(in, t0, c, D, E, l2norm, w.state(j), ch, w.SK.data(), w.row.data(), static_cast<Acc*>(nullptr));
            if (more) {
              std::copy(w.state(j), w.state(j) + D * E, w.state(j + 1));
              update_state(w.state(j + 1), ch, gated, c, D, E, w.tmp.data());
            }
          },
          [&](const Row<T, Acc>& in, const RowGrads<T, Acc>& out, Acc* R, int64_t j, int64_t t0, int c) {
            ChunkTerms<Acc> ch = w.terms(j, gated);
            if (gated) ch.elast = exp_nonpositive(static_cast<Acc>(ch.b[c - 1]));  // as chunk_gates returned it
            chunk_backward(in, out, t0, c, l2norm, static_cast<Acc>(scale), ch, w.state(j), R, w);
          });
    }
  });
}

// Returns (dq, dk, dv, dbeta, dg, dS0); dg is empty without g. dS: ∂L/∂S of the final state or None.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> delta_chunked_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& beta_in,
    const c10::optional<at::Tensor>& g_in, const at::Tensor& S_blocks_in, const at::Tensor& do_in,
    const c10::optional<at::Tensor>& dS, double scale, bool l2norm, int64_t chunk,
    const c10::optional<at::Tensor>& cu_seqlens) {
  const char* op = "linattn_cpu::delta_chunked_backward";
  const Rows rows = check_inputs(op, q_in, k_in, v_in, beta_in, g_in.has_value() ? &*g_in : nullptr, false,
                                 S_blocks_in, true, chunk, cu_seqlens, "the saved block states do not match q, k, v");
  BackwardTensors t(op, rows, q_in, k_in, v_in, beta_in, S_blocks_in, do_in, dS);
  const at::Tensor g = g_in.has_value() ? g_in->contiguous() : at::Tensor();
  at::Tensor dg = at::empty(g.defined() ? g.sizes() : at::IntArrayRef{0}, t.S_blocks.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, t.q.scalar_type(), "linattn_cpu_delta_chunked_backward", [&] {
    backward_rows<scalar_t>(rows, t.q, t.k, t.v, t.beta, g.defined() ? &g : nullptr, t.S_blocks, t.dO, t.dq, t.dk,
                            t.dv, t.dbeta, g.defined() ? &dg : nullptr, t.R, scale, l2norm, chunk);
  });
  return {t.dq, t.dk, t.dv, t.dbeta, dg, t.initial_state_grad(rows)};
}

// Returns (o, S, S_blocks); S_blocks (the saved blocks of every row, D, E) is empty unless save (training).
std::tuple<at::Tensor, at::Tensor, at::Tensor> delta_chunked(const at::Tensor& q_in, const at::Tensor& k_in,
                                                             const at::Tensor& v_in, const at::Tensor& beta_in,
                                                             const c10::optional<at::Tensor>& g_in,
                                                             const at::Tensor& S0, double scale, bool l2norm,
                                                             int64_t chunk, bool save,
                                                             const c10::optional<at::Tensor>& cu_seqlens) {
  const Rows rows = check_inputs("linattn_cpu::delta_chunked", q_in, k_in, v_in, beta_in,
                                 g_in.has_value() ? &*g_in : nullptr, false, S0, false, chunk, cu_seqlens,
                                 "the state must be (B, H, D, E) (S for B with cu_seqlens)");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), beta = beta_in.contiguous();
  const at::Tensor g = g_in.has_value() ? g_in->contiguous() : at::Tensor();
  const int64_t D = q.size(3), E = v.size(3);
  at::Tensor S = S0.contiguous().clone().view({rows.sequences(), q.size(1), D, E});
  at::Tensor o = empty_result(v.sizes(), v.options());
  at::Tensor S_blocks = at::empty({save ? rows.blocks() : 0, D, E}, S.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_delta_chunked", [&] {
    forward_rows<scalar_t>(rows, q, k, v, beta, g.defined() ? &g : nullptr, o, S, save ? &S_blocks : nullptr, scale, l2norm,
                           chunk);
  });
  return {o, S, S_blocks};
}

// β in [0, 2] and g ≤ 0, finite, for the n values of each (either may be undefined): raises a
// ValueError naming the argument, as linattn's own checks do
template <typename Acc>
void check_gate_values(const at::Tensor& beta, const at::Tensor& g) {
  const Acc* b = beta.data_ptr<Acc>();
  for (int64_t i = 0; i < beta.numel(); ++i) {
    TORCH_CHECK_VALUE(b[i] >= Acc(0) && b[i] <= Acc(2), "beta must lie in [0, 2] (finite), got ", b[i]);
  }
  if (!g.defined()) return;
  const Acc* p = g.data_ptr<Acc>();
  for (int64_t i = 0; i < g.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] <= Acc(0) && std::isfinite(p[i]), "g must be a finite log-decay ≤ 0, got ", p[i]);
  }
}

// α = e^g for the D values of g (≤ 0, checked before), vectorized
template <typename Acc>
LINATTN_CLONES void channel_decays(const Acc* __restrict__ g, Acc* __restrict__ alpha, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) alpha[d] = exp_nonpositive(g[d]);
}

// S (B, H, D, E) in Acc, q, k (B, H, 1, D), v (B, H, 1, E), β (B, H, 1) and g (B, H, 1) or (B, H, 1, D)
// in Acc (g optional): the checks and the rows of one token, S' written into S2 (contiguous, shaped
// like S; S itself for the in-place step: delta_row reads every entry before writing it). Returns o
// shaped like v.
at::Tensor delta_step_into(const char* op, const at::Tensor& S, const at::Tensor& q_in, const at::Tensor& k_in,
                           const at::Tensor& v_in, const at::Tensor& beta_in, const c10::optional<at::Tensor>& g_in,
                           double scale, bool l2norm, at::Tensor& S2) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1 && k_in.sizes() == q_in.sizes() && v_in.dim() == 4 &&
                  v_in.sizes().slice(0, 3) == q_in.sizes().slice(0, 3),
              op, " expects q, k (B, H, 1, D) and v (B, H, 1, E)");
  const int64_t D = q_in.size(3), E = v_in.size(3), rows = q_in.size(0) * q_in.size(1);
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(), op,
              ": q, k, v must share a dtype");
  const auto acc = q_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(S.scalar_type() == acc && beta_in.scalar_type() == acc && (!g_in.has_value() || g_in->scalar_type() == acc),
              op, ": the state, beta and g must be float64 for float64 inputs, else float32");
  const bool channels = g_in.has_value() && g_in->dim() == 4;
  TORCH_CHECK(S.numel() == rows * D * E && beta_in.numel() == rows &&
                  (!g_in.has_value() || g_in->numel() == (channels ? rows * D : rows)),
              op, ": shapes of the state, beta and g do not agree with q, v");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const at::Tensor beta = beta_in.contiguous(), g = g_in.has_value() ? g_in->contiguous() : at::Tensor();
  at::Tensor o = at::empty(v_in.sizes(), v.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_delta_step", [&] {
    using Acc = linattn_acc<scalar_t>;
    check_gate_values<Acc>(beta, g);
    const scalar_t *pq = q.data_ptr<scalar_t>(), *pk = k.data_ptr<scalar_t>(), *pv = v.data_ptr<scalar_t>();
    const Acc *pS = S.data_ptr<Acc>(), *pb = beta.data_ptr<Acc>(), *pg = g.defined() ? g.data_ptr<Acc>() : nullptr;
    Acc* pS2 = S2.data_ptr<Acc>();
    scalar_t* po = o.data_ptr<scalar_t>();
    // one row is 2·D·E multiply-adds: only large batches are worth waking other threads for
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, D * E));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      const FlushDenormals flush;  // α S with α = e^g tiny
      Aligned<Acc> work(2 * D + 2 + (channels ? D : 0));  // q̂ k̂, the norms, α
      Acc *qk = work.data(), *rn = qk + 2 * D, *alpha = rn + 2;
      for (int64_t r = r0; r < r1; ++r) {
        load_rows(pq + r * D, qk, rn, 1, D, l2norm);
        load_rows(pk + r * D, qk + D, rn + 1, 1, D, l2norm);
        if (channels) {
          channel_decays(pg + r * D, alpha, D);
          delta_row<scalar_t, Acc, true>(pS + r * D * E, pS2 + r * D * E, qk, pv + r * E, pb[r], alpha,
                                         static_cast<Acc>(scale), po + r * E, D, E);
          continue;
        }
        const Acc a = pg != nullptr ? std::exp(pg[r]) : Acc(1);
        delta_update_row<scalar_t, Acc>(pS + r * D * E, pS2 + r * D * E, qk, pv + r * E, pb[r], a,
                                        static_cast<Acc>(scale), po + r * E, D, E);
      }
    });
  });
  return o;
}

// One token of the recurrence (delta_step_into). Returns (o, S'); S is left as it was.
std::tuple<at::Tensor, at::Tensor> delta_step(const at::Tensor& S_in, const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& beta,
                                              const c10::optional<at::Tensor>& g, double scale, bool l2norm) {
  const at::Tensor S = S_in.contiguous();
  at::Tensor S2 = at::empty(S_in.sizes(), S.options());
  at::Tensor o = delta_step_into("linattn_cpu::delta_step", S, q, k, v, beta, g, scale, l2norm, S2);
  return {o, S2};
}

// The same, S' written over S (contiguous): no new state per token (decoding). Returns o.
at::Tensor delta_step_(at::Tensor& S, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& beta, const c10::optional<at::Tensor>& g, double scale, bool l2norm) {
  TORCH_CHECK(S.is_contiguous(), "linattn_cpu::delta_step_: the state must be contiguous (it is updated in place)");
  return delta_step_into("linattn_cpu::delta_step_", S, q, k, v, beta, g, scale, l2norm, S);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def("delta_has_blas() -> bool", delta_has_blas);
  m.def(
      "delta_chunked(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? g, Tensor S0, float scale, bool l2norm, "
      "int chunk, bool save, Tensor? cu_seqlens=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "delta_chunked_backward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? g, Tensor S_blocks, Tensor do, "
      "Tensor? dS, float scale, bool l2norm, int chunk, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "delta_step(Tensor S, Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? g, float scale, bool l2norm) "
      "-> (Tensor, Tensor)");
  m.def(
      "delta_step_(Tensor(a!) S, Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? g, float scale, bool l2norm) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("delta_chunked", delta_chunked);
  m.impl("delta_chunked_backward", delta_chunked_backward);
  m.impl("delta_step", delta_step);
  m.impl("delta_step_", delta_step_);
}
