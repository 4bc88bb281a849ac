// Chunked gated linear attention on the CPU, forward and backward (docs/mechanisms.md#gla,
// "Compiled chunked form"): S_t = diag(exp(a_t)) S_{t-1} + k_t v_t^T, o_t = q_t^T S_t, q pre-scaled.
//
// Time is cut into chunks of C steps. With b_t the within-chunk cumulative log-decay and g = b_{L-1}:
//   o_t     = (q_t * e^{b_t})^T S_n + sum_{s <= t} A_ts v_s,   A_ts = sum_d q_td k_sd e^{b_td - b_sd}
//   S_{n+1} = e^{g} * S_n + sum_s (k_s * e^{g - b_s}) v_s^T
// Every exponent is <= 0. A is built from sub-chunks of c steps: a diagonal (c x c) block exactly,
// one exponential per (t, s, d); an off-diagonal block through r, the step before the query's
// sub-chunk, e^{b_t - b_s} = e^{b_t - b_r} e^{b_r - b_s}, as one matrix product.
//
// Three phases, each parallel: (1) per chunk, the intra-chunk output and the chunk's own state
// contribution; (2) per head, the scan S_{n+1} = e^{g} S_n + U_n over chunks (elementwise);
// (3) per chunk, the readout of the entry state. The backward pass mirrors it: a reverse scan of
// the state gradients, then every chunk's gradients independently, with
// db_t = q_t dq_t - k_t dk_t (+ dg at the chunk's last step) and da = reverse cumsum of db.
//
// Layouts: q, k, a (BH, T, K); v, o (BH, T, V); states (BH, N + 1, K, V); g (BH, N, K).
#include "common.h"

namespace attnlab {
namespace {

struct Dims {
  i64 BH, T, K, V, C, c;
  int threads;
  i64 chunks() const { return (T + C - 1) / C; }
};

template <typename T>
struct Chunk {  // scratch of one thread for one chunk; b and g in log2 units
  const Dims& d;
  i64 bh, n, t0, L;
  std::vector<T> b, g, A, Qo, Ko, tmp;
  Chunk(const Dims& d_) : d(d_), b(d_.C * d_.K), g(d_.K), A(d_.C * d_.C), Qo(d_.c * d_.K), Ko(d_.C * d_.K),
                          tmp(d_.C * d_.K) {}

  void load(i64 task, const T* a) {
    const i64 N = d.chunks();
    bh = task / N, n = task % N, t0 = n * d.C, L = std::min(d.C, d.T - t0);
    const T* ap = a + (bh * d.T + t0) * d.K;
    for (i64 e = 0; e < d.K; ++e) b[e] = ap[e] * T(LOG2E);
    for (i64 t = 1; t < L; ++t)
      for (i64 e = 0; e < d.K; ++e) b[t * d.K + e] = b[(t - 1) * d.K + e] + ap[t * d.K + e] * T(LOG2E);
    std::copy(b.begin() + (L - 1) * d.K, b.begin() + L * d.K, g.begin());
  }
  i64 row(i64 t = 0) const { return bh * d.T + t0 + t; }

  // A (L x L, ld C, zero above the diagonal). With dA given (the gradient of A), the gradients
  // through A are added to dq, dk (rows of this chunk, ld K).
  void build_A(const T* q, const T* k, const T* dA = nullptr, T* dq = nullptr, T* dk = nullptr) {
    const i64 K = d.K;
    for (i64 t = 0; t < L; ++t) std::fill(A.begin() + t * d.C, A.begin() + t * d.C + L, T(0));
    for (i64 s0 = 0; s0 < L; s0 += d.c) {
      const i64 s1 = std::min(s0 + d.c, L);
      for (i64 t = s0; t < s1; ++t) {
        const T* __restrict qt = q + t * K;
        const T* __restrict bt = b.data() + t * K;
        for (i64 s = s0; s <= t; ++s) {
          const T* __restrict ks = k + s * K;
          const T* __restrict bs = b.data() + s * K;
          T sum = 0;
          if (dA == nullptr) {
#pragma omp simd reduction(+ : sum)
            for (i64 e = 0; e < K; ++e) sum += qt[e] * ks[e] * ex2(bt[e] - bs[e]);
          } else {
            const T w = dA[t * d.C + s];
            T* __restrict dqt = dq + t * K;
            T* __restrict dks = dk + s * K;
#pragma omp simd reduction(+ : sum)
            for (i64 e = 0; e < K; ++e) {
              const T f = ex2(bt[e] - bs[e]);
              sum += qt[e] * ks[e] * f;
              dqt[e] += w * ks[e] * f;
              dks[e] += w * qt[e] * f;
            }
          }
          A[t * d.C + s] = sum;
        }
      }
      if (s0 == 0) continue;
      const T* br = b.data() + (s0 - 1) * K;  // the step before this sub-chunk
      for (i64 t = s0; t < s1; ++t)
        for (i64 e = 0; e < K; ++e) Qo[(t - s0) * K + e] = q[t * K + e] * ex2(b[t * K + e] - br[e]);
      for (i64 s = 0; s < s0; ++s)
        for (i64 e = 0; e < K; ++e) Ko[s * K + e] = k[s * K + e] * ex2(br[e] - b[s * K + e]);
      mm<T>(false, true, s1 - s0, s0, K, 1, Qo.data(), K, Ko.data(), K, 0, A.data() + s0 * d.C, d.C);
      if (dA == nullptr) continue;
      // dQo = dA_blk Ko -> dq += dQo e^{b_t - b_r};  dKo = dA_blk^T Qo -> dk += dKo e^{b_r - b_s}
      mm<T>(false, false, s1 - s0, K, s0, 1, dA + s0 * d.C, d.C, Ko.data(), K, 0, tmp.data(), K);
      for (i64 t = s0; t < s1; ++t)
        for (i64 e = 0; e < K; ++e) dq[t * K + e] += tmp[(t - s0) * K + e] * ex2(b[t * K + e] - br[e]);
      mm<T>(true, false, s0, K, s1 - s0, 1, dA + s0 * d.C, d.C, Qo.data(), K, 0, tmp.data(), K);
      for (i64 s = 0; s < s0; ++s)
        for (i64 e = 0; e < K; ++e) dk[s * K + e] += tmp[s * K + e] * ex2(br[e] - b[s * K + e]);
    }
  }

  // out (L x K) = x * e^{b} (decay from the chunk's start) or x * e^{g - b} (decay to its end)
  void scale_rows(const T* x, T* out, bool to_end) const {
    for (i64 t = 0; t < L; ++t)
      for (i64 e = 0; e < d.K; ++e) {
        const T be = b[t * d.K + e];
        out[t * d.K + e] = x[t * d.K + e] * ex2(to_end ? g[e] - be : be);
      }
  }
};

// states[bh][n + 1] += e^{g_n} * states[bh][n] for n = 0 .. N-1 (forward), or
// dstates[bh][n] += e^{g_n} * dstates[bh][n + 1] for n = N-1 .. 0 (backward)
template <typename T>
void scan(const Dims& d, T* states, const T* g, bool reverse) {
  const i64 N = d.chunks(), KV = d.K * d.V;
#pragma omp parallel for num_threads(d.threads) schedule(static)
  for (i64 bh = 0; bh < d.BH; ++bh) {
    T* st = states + bh * (N + 1) * KV;
    for (i64 i = 0; i < N; ++i) {
      const i64 n = reverse ? N - 1 - i : i;
      const T* src = st + (reverse ? n + 1 : n) * KV;
      T* dst = st + (reverse ? n : n + 1) * KV;
      const T* gn = g + (bh * N + n) * d.K;
      for (i64 e = 0; e < d.K; ++e) {
        const T f = ex2(gn[e]);
        for (i64 j = 0; j < d.V; ++j) dst[e * d.V + j] += f * src[e * d.V + j];
      }
    }
  }
}

// Runs body(ch, task, r0) for every (batch*head, chunk) task in parallel, each thread with its own
// Chunk workspace loaded with the task's decay sums; r0 is the task's first row.
template <typename T, typename Body>
void each_chunk(const Dims& d, const T* a, Body&& body) {
#pragma omp parallel num_threads(d.threads)
  {
    Chunk<T> ch(d);
#pragma omp for schedule(dynamic, 1)
    for (i64 task = 0; task < d.BH * d.chunks(); ++task) {
      ch.load(task, a);
      body(ch, task, ch.row());
    }
  }
}

template <typename T>
void forward(const Dims& d, const T* q, const T* k, const T* v, const T* a, const T* s0, T* o, T* states, T* g) {
  const i64 N = d.chunks(), KV = d.K * d.V, K = d.K, V = d.V;
  each_chunk(d, a, [&](Chunk<T>& ch, i64 task, i64 r0) {
    ch.build_A(q + r0 * K, k + r0 * K);
    mm<T>(false, false, ch.L, V, ch.L, 1, ch.A.data(), d.C, v + r0 * V, V, 0, o + r0 * V, V);
    ch.scale_rows(k + r0 * K, ch.tmp.data(), true);
    T* u = states + (ch.bh * (N + 1) + ch.n + 1) * KV;  // the chunk's own contribution, for the scan
    mm<T>(true, false, K, V, ch.L, 1, ch.tmp.data(), K, v + r0 * V, V, 0, u, V);
    std::copy(ch.g.begin(), ch.g.end(), g + task * K);
  });
  for (i64 bh = 0; bh < d.BH; ++bh) std::copy(s0 + bh * KV, s0 + (bh + 1) * KV, states + bh * (N + 1) * KV);
  scan(d, states, g, false);
  each_chunk(d, a, [&](Chunk<T>& ch, i64, i64 r0) {
    ch.scale_rows(q + r0 * K, ch.tmp.data(), false);
    const T* sn = states + (ch.bh * (N + 1) + ch.n) * KV;
    mm<T>(false, false, ch.L, V, K, 1, ch.tmp.data(), K, sn, V, 1, o + r0 * V, V);
  });
}

template <typename T>
void backward(const Dims& d, const T* q, const T* k, const T* v, const T* a, const T* states, const T* dout,
              const T* dfinal, T* dq, T* dk, T* dv, T* da, T* ds0, T* dstates, T* g) {
  const i64 N = d.chunks(), KV = d.K * d.V, K = d.K, V = d.V;
  each_chunk(d, a, [&](Chunk<T>& ch, i64 task, i64 r0) {  // dS_n gets (q e^{b})^T do from its own chunk
    ch.scale_rows(q + r0 * K, ch.tmp.data(), false);
    T* w = dstates + (ch.bh * (N + 1) + ch.n) * KV;
    mm<T>(true, false, K, V, ch.L, 1, ch.tmp.data(), K, dout + r0 * V, V, 0, w, V);
    std::copy(ch.g.begin(), ch.g.end(), g + task * K);
  });
  for (i64 bh = 0; bh < d.BH; ++bh)
    std::copy(dfinal + bh * KV, dfinal + (bh + 1) * KV, dstates + (bh * (N + 1) + N) * KV);
  scan(d, dstates, g, true);
  for (i64 bh = 0; bh < d.BH; ++bh)
    std::copy(dstates + bh * (N + 1) * KV, dstates + (bh * (N + 1) + 1) * KV, ds0 + bh * KV);
#pragma omp parallel num_threads(d.threads)
  {
    Chunk<T> ch(d);
    std::vector<T> dA(d.C * d.C), ke(d.C * K), dg(K);
#pragma omp for schedule(dynamic, 1)
    for (i64 task = 0; task < d.BH * N; ++task) {
      ch.load(task, a);
      const i64 r0 = ch.row(), L = ch.L;
      const T* qc = q + r0 * K;
      const T* kc = k + r0 * K;
      const T* vc = v + r0 * V;
      const T* doc = dout + r0 * V;
      const T* sn = states + (ch.bh * (N + 1) + ch.n) * KV;
      const T* dsn = dstates + (ch.bh * (N + 1) + ch.n + 1) * KV;  // gradient of the state after the chunk
      T* dqc = dq + r0 * K;
      T* dkc = dk + r0 * K;
      // state terms: dq = (do S_n^T) e^{b}; dk = (v dS^T) e^{g - b}
      mm<T>(false, true, L, K, V, 1, doc, V, sn, V, 0, dqc, K);
      mm<T>(false, true, L, K, V, 1, vc, V, dsn, V, 0, dkc, K);
      for (i64 t = 0; t < L; ++t)
        for (i64 e = 0; e < K; ++e) {
          const T be = ch.b[t * K + e];
          dqc[t * K + e] *= ex2(be);
          dkc[t * K + e] *= ex2(ch.g[e] - be);
        }
      // dg = e^{g} rowsum(S_n * dS) + sum_s k_s dk_s (the state part of dk, before the intra terms)
      for (i64 e = 0; e < K; ++e) {
        T acc = 0;
        for (i64 j = 0; j < V; ++j) acc += sn[e * V + j] * dsn[e * V + j];
        dg[e] = acc * ex2(ch.g[e]);
      }
      for (i64 t = 0; t < L; ++t)
        for (i64 e = 0; e < K; ++e) dg[e] += kc[t * K + e] * dkc[t * K + e];
      // intra-chunk terms
      mm<T>(false, true, L, L, V, 1, doc, V, vc, V, 0, dA.data(), d.C);
      for (i64 t = 0; t < L; ++t) std::fill(dA.begin() + t * d.C + t + 1, dA.begin() + t * d.C + L, T(0));
      ch.build_A(qc, kc, dA.data(), dqc, dkc);
      T* dvc = dv + r0 * V;
      mm<T>(true, false, L, V, L, 1, ch.A.data(), d.C, doc, V, 0, dvc, V);
      ch.scale_rows(kc, ke.data(), true);
      mm<T>(false, false, L, V, K, 1, ke.data(), K, dsn, V, 1, dvc, V);
      // db_t = q_t dq_t - k_t dk_t, plus dg at the last step; da = reverse cumsum of db
      T* dac = da + r0 * K;
      for (i64 e = 0; e < K; ++e) dg[e] += qc[(L - 1) * K + e] * dqc[(L - 1) * K + e] - kc[(L - 1) * K + e] * dkc[(L - 1) * K + e];
      std::copy(dg.begin(), dg.end(), dac + (L - 1) * K);
      for (i64 t = L - 2; t >= 0; --t)
        for (i64 e = 0; e < K; ++e)
          dac[t * K + e] = dac[(t + 1) * K + e] + qc[t * K + e] * dqc[t * K + e] - kc[t * K + e] * dkc[t * K + e];
    }
  }
}

}  // namespace
}  // namespace attnlab

using attnlab::i64;

#define ATTNLAB_GLA(T, SUFFIX)                                                                                 \
  extern "C" int attnlab_gla_fwd_##SUFFIX(const T* q, const T* k, const T* v, const T* a, const T* s0, T* o,   \
                                          T* states, T* g, i64 BH, i64 Tn, i64 K, i64 V, i64 C, i64 c,        \
                                          int threads) {                                                       \
    attnlab::forward<T>({BH, Tn, K, V, C, c, std::max(threads, 1)}, q, k, v, a, s0, o, states, g);             \
    return 0;                                                                                                  \
  }                                                                                                            \
  extern "C" int attnlab_gla_bwd_##SUFFIX(const T* q, const T* k, const T* v, const T* a, const T* states,     \
                                          const T* dout, const T* dfinal, T* dq, T* dk, T* dv, T* da, T* ds0,  \
                                          T* dstates, T* g, i64 BH, i64 Tn, i64 K, i64 V, i64 C, i64 c,       \
                                          int threads) {                                                       \
    attnlab::backward<T>({BH, Tn, K, V, C, c, std::max(threads, 1)}, q, k, v, a, states, dout, dfinal, dq, dk, \
                         dv, da, ds0, dstates, g);                                                             \
    return 0;                                                                                                  \
  }

ATTNLAB_GLA(float, f32)
ATTNLAB_GLA(double, f64)
