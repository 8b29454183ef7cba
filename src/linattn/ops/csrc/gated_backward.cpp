// The backward of the gated chunked forward (linattn_cpu::gated_chunked_backward; the maths in gated.h):
// one (batch, head) row per task (or, with cu_seqlens, one per sequence and head: rows.h), blocks and
// chunks in reverse, the states entering the chunks of a block recomputed from the one saved for it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "gated.h"
#include "pool.h"
#include "rows.h"

namespace {

using linattn_pool::empty_result;

// Queues cache hints (prefetch.h) for the rows [t, t + n) the backward reads next (v, do, o, g) and
// writes (dq, dk, dv, dg): the chunk before the one about to run, while its products run
template <typename T, typename Acc>
void prefetch_chunk_before(const T* v, const T* dout, const T* o, const Acc* g, T* dq, T* dk, T* dv, Acc* dg, int64_t t,
                           int64_t n, int64_t F, int64_t E, int64_t G) {
  const int64_t b = sizeof(T), a = sizeof(Acc);
  prefetch_queue().flush();
  prefetch_soon(v + t * E, n * E * b);
  prefetch_soon(dout + t * E, n * E * b);
  prefetch_soon(o + t * E, n * E * b);
  prefetch_soon(g + t * G, n * G * a);
  prefetch_soon(dq + t * F, n * F * b, true);
  prefetch_soon(dk + t * F, n * F * b, true);
  prefetch_soon(dv + t * E, n * E * b, true);
  prefetch_soon(dg + t * G, n * G * a, true);
}

// What the backward of one chunk or piece reads and writes besides the work buffers
template <typename T>
struct Grads {
  using Acc = linattn_acc<T>;
  Aligned<Acc> G, gd, dQ, dK, dV, P;
  Aligned<T> G_low, P_low, R_low, S_low;

  Grads(int64_t chunk, int64_t F, int64_t E)
      : G(chunk * E),
        gd(chunk),
        dQ(chunk * F),
        dK(chunk * F),
        dV(chunk * E),
        P(chunk * chunk),
        G_low(Work<T>::low ? chunk * E : 0),
        P_low(Work<T>::low ? chunk * chunk : 0),
        R_low(Work<T>::low ? F * E : 0),
        S_low(Work<T>::low ? F * E : 0) {}
};

// Row pointers of one chunk or piece in the backward (t0: its first token's index in (B·H·N))
template <typename T>
struct Span {
  using Acc = linattn_acc<T>;
  int c;
  const T *Q, *K, *V, *dO, *O;
  const Acc *Qa, *Ka, *fQ, *fK, *den, *g;
  T *dq, *dk, *dv;
  Acc* dg;
};

// ∂V = Aᵀ G + Kw R into the span's dv (bf16: through dV); A, Kw given as operands
template <typename T>
void values_grad(Grads<T>& gr, const Span<T>& sp, int64_t F, int64_t E, const T* A_op, const T* Kw_op, const T* G_op,
                 const T* R_op) {
  using Acc = linattn_acc<T>;
  const int c = sp.c, f = static_cast<int>(F), e = static_cast<int>(E);
  Acc* dV = Work<T>::low ? gr.dV.data() : reinterpret_cast<Acc*>(sp.dv);
  gemm_rm<T>(true, false, c, e, c, A_op, c, G_op, e, Acc(0), dV, e);
  gemm_rm<T>(false, false, c, e, f, Kw_op, f, R_op, e, Acc(1), dV, e);
  if constexpr (Work<T>::low) narrow_bf16(dV, sp.dv, int64_t(c) * E);
}

// The states around one chunk (or vector-gated piece) of the backward: (S, z) entering it and (S_out, z_out)
// after it (z, z_out null without normalize); (R, r) the gradients flowing into the state after it, which
// the chunk's backward updates to those entering it.
template <typename Acc>
struct ChunkStates {
  const Acc *S, *z, *S_out, *z_out;
  Acc *R, *r;
};

// The backward of one chunk of scalar gates (its states in st)
template <typename T>
void scalar_chunk_backward(Work<T>& wk, Grads<T>& gr, const Span<T>& sp, int64_t F, int64_t E,
                           const ChunkStates<linattn_acc<T>>& st, bool normalize, double* carry) {
  using Acc = linattn_acc<T>;
  const int c = sp.c, f = static_cast<int>(F), e = static_cast<int>(E);
  const int64_t cc = int64_t(c) * c;
  end_term(st.S_out, st.R, st.z_out, st.r, F, E, false, carry);
  scalar_decays(sp.g, c, wk.beta.data(), wk.eb.data(), wk.w.data());
  gemm_rm<T>(false, true, c, c, f, sp.Q, f, sp.K, f, Acc(0), wk.A.data(), c);  // A = (Q̃K̃ᵀ) ⊙ D
  decay_scores(wk.A.data(), wk.D.data(), c, wk.beta.data());
  output_grads(sp.dO, sp.O, sp.den, normalize, gr.G.data(), gr.gd.data(), c, E);
  const T* G_op = as_operand<T>(gr.G.data(), gr.G_low, int64_t(c) * E);
  const T* R_op = as_operand<T>(st.R, gr.R_low, F * E);
  weighted_rows(sp.Ka, wk.w.data(), c, F, wk.Kv.data());  // K̂ = e^{λ−β} ⊙ K̃
  const T* Kw_op = as_operand<T>(wk.Kv.data(), wk.Kv_low, int64_t(c) * F);
  values_grad<T>(gr, sp, F, E, as_operand<T>(wk.A.data(), wk.A_low, cc), Kw_op, G_op, R_op);
  // P = M ⊙ D ⊙ (G Vᵀ + g 1ᵀ)
  gemm_rm<T>(false, true, c, c, e, G_op, e, sp.V, e, Acc(0), gr.P.data(), c);
  add_rows_and_decay(gr.P.data(), normalize ? gr.gd.data() : nullptr, wk.D.data(), c);
  const T* P_op = as_operand<T>(gr.P.data(), gr.P_low, cc);
  // dQ̃ = e^{β} ⊙ (G Sᵀ + g zᵀ) + P K̃
  gemm_rm<T>(false, true, c, f, e, G_op, e, as_operand<T>(st.S, gr.S_low, F * E), e, Acc(0), gr.dQ.data(), f);
  if (normalize) add_outer(gr.dQ.data(), gr.gd.data(), st.z, c, F);
  scale_rows(gr.dQ.data(), wk.eb.data(), c, F);
  gemm_rm<T>(false, false, c, f, c, P_op, c, sp.K, f, Acc(1), gr.dQ.data(), f);
  // dK̃ = e^{λ−β} ⊙ (V Rᵀ + 1 rᵀ) + Pᵀ Q̃
  gemm_rm<T>(false, true, c, f, e, sp.V, e, R_op, e, Acc(0), gr.dK.data(), f);
  if (normalize) add_outer<Acc>(gr.dK.data(), nullptr, st.r, c, F);
  scale_rows(gr.dK.data(), wk.w.data(), c, F);
  gemm_rm<T>(true, false, c, f, c, P_op, c, sp.Q, f, Acc(1), gr.dK.data(), f);
  gate_grads(sp.Qa, gr.dQ.data(), sp.Ka, gr.dK.data(), sp.g, c, F, false, carry, sp.dg);
  // (R, r) ← e^{λ} (R, r) + Q̃ᵀ (e^{β} ⊙ (G, g))
  const Acc ec = wk.eb.data()[c - 1];
  scale_rows(gr.G.data(), wk.eb.data(), c, E);
  scale_all(st.R, F * E, ec);
  gemm_rm<T>(true, false, f, e, c, sp.Q, f, as_operand<T>(gr.G.data(), gr.G_low, int64_t(c) * E), e, Acc(1), st.R, e);
  if (normalize) {
    for (int i = 0; i < c; ++i) gr.gd.data()[i] *= wk.eb.data()[i];
    scale_all(st.r, F, ec);
    add_weighted_rows(st.r, gr.gd.data(), sp.Qa, c, F);
  }
  chain_features(gr.dQ.data(), sp.fQ, sp.dq, int64_t(c) * F);
  chain_features(gr.dK.data(), sp.fK, sp.dk, int64_t(c) * F);
}

// The backward of one vector-gated piece (its states in st)
template <typename T>
void piece_backward(Work<T>& wk, Grads<T>& gr, const Span<T>& sp, int64_t F, int64_t E,
                    const ChunkStates<linattn_acc<T>>& st, bool normalize, double* carry) {
  using Acc = linattn_acc<T>;
  const int c = sp.c, f = static_cast<int>(F), e = static_cast<int>(E);
  const int64_t cc = int64_t(c) * c;
  end_term(st.S_out, st.R, st.z_out, st.r, F, E, true, carry);
  piece_factors(sp.g, c, F, sp.Qa, sp.Ka, wk.sum.data(), wk.dec.data(), wk.w.data(), wk.Qv.data(), wk.Kv.data());
  decayed_rows(st.S, wk.dec.data(), F, E, wk.S_hat.data());  // Ŝ = e^{λ} ⊙ S
  if (normalize) decayed_rows(st.z, wk.dec.data(), F, 1, wk.z_hat.data());
  const T* Qop = as_operand<T>(wk.Qv.data(), wk.Qv_low, c * F);
  const T* Kop = as_operand<T>(wk.Kv.data(), wk.Kv_low, c * F);
  gemm_rm<T>(false, true, c, c, f, Qop, f, Kop, f, Acc(0), wk.A.data(), c);  // A = M ⊙ Q̌K̂ᵀ
  mask_upper(wk.A.data(), c);
  output_grads(sp.dO, sp.O, sp.den, normalize, gr.G.data(), gr.gd.data(), c, E);
  const T* G_op = as_operand<T>(gr.G.data(), gr.G_low, int64_t(c) * E);
  const T* R_op = as_operand<T>(st.R, gr.R_low, F * E);
  values_grad<T>(gr, sp, F, E, as_operand<T>(wk.A.data(), wk.A_low, cc), Kop, G_op, R_op);
  // P = M ⊙ (G Vᵀ + g 1ᵀ)
  gemm_rm<T>(false, true, c, c, e, G_op, e, sp.V, e, Acc(0), gr.P.data(), c);
  if (normalize) {
    add_rows_and_mask(gr.P.data(), gr.gd.data(), c);
  } else {
    mask_upper(gr.P.data(), c);
  }
  const T* P_op = as_operand<T>(gr.P.data(), gr.P_low, cc);
  // dQ̌ = P K̂ + G Ŝᵀ + g ẑᵀ,   dK̂ = Pᵀ Q̌ + V Rᵀ + 1 rᵀ
  gemm_rm<T>(false, false, c, f, c, P_op, c, Kop, f, Acc(0), gr.dQ.data(), f);
  gemm_rm<T>(false, true, c, f, e, G_op, e, as_operand<T>(wk.S_hat.data(), gr.S_low, F * E), e, Acc(1), gr.dQ.data(),
             f);
  if (normalize) add_outer(gr.dQ.data(), gr.gd.data(), wk.z_hat.data(), c, F);
  gemm_rm<T>(true, false, c, f, c, P_op, c, Qop, f, Acc(0), gr.dK.data(), f);
  gemm_rm<T>(false, true, c, f, e, sp.V, e, R_op, e, Acc(1), gr.dK.data(), f);
  if (normalize) add_outer<Acc>(gr.dK.data(), nullptr, st.r, c, F);
  // q ⊙ dq − k ⊙ dk = Q̌ ⊙ dQ̌ − K̂ ⊙ dK̂
  gate_grads(wk.Qv.data(), gr.dQ.data(), wk.Kv.data(), gr.dK.data(), sp.g, c, F, true, carry, sp.dg);
  // (R, r) ← e^{λ} ⊙ ((R, r) + Q̌ᵀ (G, g))
  gemm_rm<T>(true, false, f, e, c, Qop, f, G_op, e, Acc(1), st.R, e);
  decay_rows(st.R, wk.dec.data(), F, E);
  if (normalize) {
    add_weighted_rows(st.r, gr.gd.data(), wk.Qv.data(), c, F);
    decay_rows(st.r, wk.dec.data(), F, 1);
  }
  unscale_grads(gr.dQ.data(), gr.dK.data(), wk.w.data(), int64_t(c) * F);
  chain_features(gr.dQ.data(), sp.fQ, sp.dq, int64_t(c) * F);
  chain_features(gr.dK.data(), sp.fK, sp.dk, int64_t(c) * F);
}

// A vector-gated chunk backward: its pieces in reverse, each between the states entering and leaving it
// (recomputed into Sp, zp when the chunk has more than one piece), cut where the forward cut it
template <typename T>
void vector_chunk_backward(Work<T>& wk, Grads<T>& gr, const Span<T>& ch, int64_t F, int64_t E,
                           const ChunkStates<linattn_acc<T>>& st, bool normalize, double* carry,
                           std::vector<int>& starts, std::vector<linattn_acc<T>>& Sp, std::vector<linattn_acc<T>>& zp) {
  const auto [S, z, S_out, z_out, R, rr] = st;
  starts.clear();
  bool valid = true;  // the forward checked the gates
  for (int p = 0; p < ch.c;) {
    starts.push_back(p);
    p += piece_length(ch.g + p * F, ch.c - p, F, wk.span.data(), valid);
  }
  const int np = static_cast<int>(starts.size());
  starts.push_back(ch.c);
  if (np > 1) {
    Sp.resize(np * F * E);
    zp.resize(normalize ? np * F : 0);
    std::copy(S, S + F * E, Sp.begin());
    if (normalize) std::copy(z, z + F, zp.begin());
    for (int i = 0; i + 1 < np; ++i) {
      const int p = starts[i], len = starts[i + 1] - p;
      std::copy(Sp.begin() + i * F * E, Sp.begin() + (i + 1) * F * E, Sp.begin() + (i + 1) * F * E);
      if (normalize) std::copy(zp.begin() + i * F, zp.begin() + (i + 1) * F, zp.begin() + (i + 1) * F);
      piece_forward<T>(wk, len, F, E, ch.Qa + p * F, ch.Ka + p * F, ch.V + p * E, ch.g + p * F,
                       Sp.data() + (i + 1) * F * E, normalize ? zp.data() + (i + 1) * F : nullptr, nullptr, normalize,
                       linattn_acc<T>(0), nullptr);
    }
  }
  for (int i = np - 1; i >= 0; --i) {
    const int p = starts[i], len = starts[i + 1] - p;
    Span<T> sp = ch;
    sp.c = len;
    sp.Q += p * F;
    sp.K += p * F;
    sp.V += p * E;
    sp.dO += p * E;
    sp.O += p * E;
    sp.Qa += p * F;
    sp.Ka += p * F;
    if (sp.fQ != nullptr) {
      sp.fQ += p * F;
      sp.fK += p * F;
    }
    if (sp.den != nullptr) sp.den += p;
    sp.g += p * F;
    sp.dq += p * F;
    sp.dk += p * F;
    sp.dv += p * E;
    sp.dg += p * F;
    const bool first = i == 0, last = i + 1 == np;
    const ChunkStates<linattn_acc<T>> piece{first ? S : Sp.data() + i * F * E,
                                            first ? z : (normalize ? zp.data() + i * F : nullptr),
                                            last ? S_out : Sp.data() + (i + 1) * F * E,
                                            last ? z_out : (normalize ? zp.data() + (i + 1) * F : nullptr), R, rr};
    piece_backward<T>(wk, gr, sp, F, E, piece, normalize, carry);
  }
}

// Per-thread chunk buffers of the fp32 path for bf16 inputs (M = float): the chunk's v, dO and o
// widened, and its dq, dk, dv before they are rounded to bf16; empty when M = T.
template <typename T, typename M>
struct WideChunk {
  static constexpr bool widen = !std::is_same<T, M>::value;
  Aligned<M> V, dO, O, dq, dk, dv;

  WideChunk(int64_t chunk, int64_t F, int64_t E)
      : V(widen ? chunk * E : 0),
        dO(widen ? chunk * E : 0),
        O(widen ? chunk * E : 0),
        dq(widen ? chunk * F : 0),
        dk(widen ? chunk * F : 0),
        dv(widen ? chunk * E : 0) {}
};

template <typename T, typename M>
void gated_backward_rows(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& o, const at::Tensor& dout, const at::Tensor& den_all,
                         const at::Tensor& S_blocks, const at::Tensor& z_blocks, const at::Tensor& kvN,
                         const at::Tensor& zN, const at::Tensor& R_all, const at::Tensor& r_all, at::Tensor& dq,
                         at::Tensor& dk, at::Tensor& dv, at::Tensor& dg, int64_t phi, bool normalize, int64_t chunk,
                         int64_t block) {
  using Acc = linattn_acc<T>;
  constexpr bool widen = WideChunk<T, M>::widen;
  const int64_t F = q.size(3), E = v.size(3), per_block = block / chunk;
  const bool vector = g.dim() == 4;
  const int64_t Gw = vector ? F : 1;
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>(), *po = o.data_ptr<T>();
  const T* pdo = dout.data_ptr<T>();
  const Acc* pg = g.data_ptr<Acc>();
  const Acc* pden = normalize ? den_all.data_ptr<Acc>() : nullptr;
  const Acc* pSb = S_blocks.data_ptr<Acc>();
  const Acc* pzb = normalize ? z_blocks.data_ptr<Acc>() : nullptr;
  const Acc* pkvN = kvN.data_ptr<Acc>();
  const Acc* pzN = normalize ? zN.data_ptr<Acc>() : nullptr;
  T *pdq = dq.data_ptr<T>(), *pdk = dk.data_ptr<T>(), *pdv = dv.data_ptr<T>();
  Acc* pdg = dg.data_ptr<Acc>();
  Acc* pR = R_all.data_ptr<Acc>();
  Acc* pr = normalize ? r_all.data_ptr<Acc>() : nullptr;
  at::parallel_for(0, rows.count(), 1, [&](int64_t i0, int64_t i1) {
    const SequentialBlas one_thread;
    Work<M> wk(chunk, F, E, vector);
    Grads<M> gr(chunk, F, E);
    BlockFeatures<T, M> fb(phi, block, F);
    WideChunk<T, M> wc(chunk, F, E);
    Aligned<Acc> Sc(per_block * F * E), zc(normalize ? per_block * F : 0);
    std::vector<double> carry(Gw);
    std::vector<int> starts;
    std::vector<Acc> Sp, zp;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = rows.row(i), N = rows.length(r), t_row = rows.start(r), first = rows.first_block(r);
      const int64_t blocks = (N + block - 1) / block;
      Acc* R = pR + r * F * E;
      Acc* rr = normalize ? pr + r * F : nullptr;
      for (int64_t b = blocks - 1; b >= 0; --b) {
        const int64_t s = b * block, m = std::min(N, s + block) - s, nch = (m + chunk - 1) / chunk;
        fb.compute(pq + (t_row + s) * F, pk + (t_row + s) * F, m * F, phi);
        std::copy(pSb + (first + b) * F * E, pSb + (first + b + 1) * F * E, Sc.begin());
        if (normalize) std::copy(pzb + (first + b) * F, pzb + (first + b + 1) * F, zc.begin());
        for (int64_t j = 0; j + 1 < nch; ++j) {  // the states entering the block's later chunks
          const int c = static_cast<int>(std::min(chunk, m - j * chunk));
          const int64_t c0 = j * chunk, t0 = t_row + s + c0;
          if (j + 2 < nch) {  // the next chunk's v and g
            prefetch_queue().flush();
            prefetch_soon(pv + (t0 + chunk) * E, chunk * E * int64_t(sizeof(T)));
            prefetch_soon(pg + (t0 + chunk) * Gw, chunk * Gw * int64_t(sizeof(Acc)));
          }
          Acc* Snext = Sc.data() + (j + 1) * F * E;
          Acc* znext = normalize ? zc.data() + (j + 1) * F : nullptr;
          std::copy(Sc.begin() + j * F * E, Sc.begin() + (j + 1) * F * E, Snext);
          if (normalize) std::copy(zc.begin() + j * F, zc.begin() + (j + 1) * F, znext);
          const M* V = as_operand<M>(pv + t0 * E, wc.V, int64_t(c) * E);
          if (vector) {
            bool valid = true;  // the forward checked the gates
            vector_chunk_forward<M>(wk, c, F, E, fb.Qa + c0 * F, fb.Ka + c0 * F, V, pg + t0 * F, Snext, znext, nullptr,
                                    normalize, Acc(0), nullptr, valid);
          } else {
            scalar_chunk_forward<M>(wk, c, F, E, fb.Q + c0 * F, fb.K + c0 * F, fb.Qa + c0 * F, fb.Ka + c0 * F, V,
                                    pg + t0, Snext, znext, nullptr, normalize, Acc(0));
          }
        }
        for (int64_t j = nch - 1; j >= 0; --j) {
          const int64_t c0 = j * chunk, t0 = t_row + s + c0;
          const int c = static_cast<int>(std::min(chunk, m - c0));
          if (j > 0) prefetch_chunk_before(pv, pdo, po, pg, pdq, pdk, pdv, pdg, t0 - chunk, chunk, F, E, Gw);
          Span<M> sp{c,
                     fb.Q + c0 * F,
                     fb.K + c0 * F,
                     as_operand<M>(pv + t0 * E, wc.V, int64_t(c) * E),
                     as_operand<M>(pdo + t0 * E, wc.dO, int64_t(c) * E),
                     as_operand<M>(po + t0 * E, wc.O, int64_t(c) * E),
                     fb.Qa + c0 * F,
                     fb.Ka + c0 * F,
                     fb.fQ == nullptr ? nullptr : fb.fQ + c0 * F,
                     fb.fK == nullptr ? nullptr : fb.fK + c0 * F,
                     normalize ? pden + t0 : nullptr,
                     pg + t0 * Gw,
                     nullptr,
                     nullptr,
                     nullptr,
                     pdg + t0 * Gw};
          if constexpr (widen) {
            sp.dq = wc.dq.data();
            sp.dk = wc.dk.data();
            sp.dv = wc.dv.data();
          } else {
            sp.dq = pdq + t0 * F;
            sp.dk = pdk + t0 * F;
            sp.dv = pdv + t0 * E;
          }
          const Acc* S = Sc.data() + j * F * E;
          const Acc* z = normalize ? zc.data() + j * F : nullptr;
          // the state after the chunk: the next chunk's, the next block's, or the final state
          const bool last_block = b + 1 == blocks;
          const Acc* S_out = j + 1 < nch   ? S + F * E
                             : last_block ? pkvN + r * F * E
                                          : pSb + (first + b + 1) * F * E;
          const Acc* z_out = !normalize     ? nullptr
                             : j + 1 < nch  ? z + F
                             : last_block   ? pzN + r * F
                                            : pzb + (first + b + 1) * F;
          const ChunkStates<Acc> st{S, z, S_out, z_out, R, rr};
          if (vector) {
            vector_chunk_backward<M>(wk, gr, sp, F, E, st, normalize, carry.data(), starts, Sp, zp);
          } else {
            scalar_chunk_backward<M>(wk, gr, sp, F, E, st, normalize, carry.data());
          }
          if constexpr (widen) {
            narrow_bf16(sp.dq, pdq + t0 * F, int64_t(c) * F);
            narrow_bf16(sp.dk, pdk + t0 * F, int64_t(c) * F);
            narrow_bf16(sp.dv, pdv + t0 * E, int64_t(c) * E);
          }
        }
      }
    }
  });
}

// Returns (dq, dk, dv, dg, dkv0, dz0); normalize = z (the final z) given. kv, z: the final state;
// dkv, dz: its gradients (undefined: zero). dz0 is empty without normalize.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_chunked_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
    const at::Tensor& o_in, const at::Tensor& do_in, const at::Tensor& den, const at::Tensor& S_blocks,
    const at::Tensor& z_blocks, const at::Tensor& kv_in, const c10::optional<at::Tensor>& z_in,
    const c10::optional<at::Tensor>& dkv, const c10::optional<at::Tensor>& dz, int64_t phi, int64_t chunk, bool wide,
    const c10::optional<at::Tensor>& cu_seqlens) {
  const char* op = "linattn_cpu::gated_chunked_backward";
  const bool normalize = z_in.has_value();
  chunk = check_inputs(op, q_in, k_in, v_in, kv_in, normalize ? *z_in : kv_in, phi, chunk, wide);
  check_gates(op, q_in, g_in, kv_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous(),
                   o = o_in.contiguous(), dout = do_in.to(v.scalar_type()).contiguous();
  TORCH_CHECK(o.sizes() == v.sizes() && dout.sizes() == v.sizes(), op, ": o and do must be shaped like v");
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), block = block_tokens(chunk);
  const Rows rows_(op, q, cu_seqlens, block);
  const int64_t rows = rows_.count(), blocks = rows_.blocks();
  TORCH_CHECK(S_blocks.numel() == blocks * F * E && kv_in.numel() == rows * F * E &&
                  (!normalize || (z_blocks.numel() == blocks * F && den.numel() == q.size(0) * q.size(1) * N &&
                                  z_in->numel() == rows * F)),
              op, ": the saved tensors do not match q, k, v");
  const auto acc = kv_in.options();
  at::Tensor R = dkv.has_value() ? dkv->to(acc).contiguous().clone() : at::zeros({rows, F, E}, acc);
  at::Tensor r = normalize ? (dz.has_value() ? dz->to(acc).contiguous().clone() : at::zeros({rows, F}, acc))
                           : at::empty({0}, acc);
  TORCH_CHECK(R.numel() == rows * F * E && (!normalize || r.numel() == rows * F), op,
              ": dkv, dz must be shaped like the state");
  at::Tensor dq = empty_result(q.sizes(), q.options()), dk = empty_result(k.sizes(), k.options()),
             dv = empty_result(v.sizes(), v.options()), dg = empty_result(g.sizes(), g.options());
  const at::Tensor den_c = den.contiguous(), Sb = S_blocks.contiguous(), zb = z_blocks.contiguous(),
                   kvN = kv_in.contiguous(), zN = normalize ? z_in->contiguous() : at::empty({0}, acc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_gated_chunked_backward", [&] {
    with_operands<scalar_t>(wide, [&](auto op_type) {
      gated_backward_rows<scalar_t, decltype(op_type)>(rows_, q, k, v, g, o, dout, den_c, Sb, zb, kvN, zN, R, r, dq, dk,
                                                       dv, dg, phi, normalize, chunk, block);
    });
  });
  const auto b = rows_.sequences(), h = q.size(1);
  return {dq, dk, dv, dg, R.view({b, h, F, E}), normalize ? r.view({b, h, F}) : r};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def(
      "gated_chunked_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor o, Tensor do, Tensor den, "
      "Tensor S_blocks, Tensor z_blocks, Tensor kv, Tensor? z, Tensor? dkv, Tensor? dz, int phi, int chunk, "
      "bool wide=False, Tensor? cu_seqlens=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) { m.impl("gated_chunked_backward", gated_chunked_backward); }
