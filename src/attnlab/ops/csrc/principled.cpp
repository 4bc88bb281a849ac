// Fused principled attention on the CPU, forward and backward (docs/mechanisms.md#principled-attention,
// "Fused CPU kernel"). The math is that of the tiled PyTorch path in ops/principled.py: per query
// block, a loop over key blocks keeps the running max M of max(0, y), the sum of 2^(y - M) v and
// of 2^(y - M), and the grounded mass sum max(0, 2^-M - 2^(y - M)), with y = log2e (a - gamma).
// Here each tile's scores, gate scores, softplus and exponentials are computed in one pass over
// the tile in registers, between three BLAS calls; no tile-sized temporaries are allocated.
//
// Layouts (row-major, contiguous): q (B, H, Tq, D), k (B, G, Tk, D), qg (B, H, Tq, Dg),
// kg (B, Gg, Tk, Dg), v (B, Gv, Tk, Dv); head h reads group h / (H / G) of k (likewise kg, v),
// so grouped heads are never copied. c, spb, gamma: (B, H, Tq) per-query scalars
// c = 1 + softplus(alpha) log K, spb = softplus(beta). Causal: query i sees key j <= i + Tk - Tq.
#include "common.h"

namespace attnlab {
namespace {

struct Dims {
  i64 B, H, G, Gg, Gv, Tq, Tk, D, Dg, Dv;
  bool causal;
  i64 bq, bk;
  int threads;
  i64 off() const { return Tk - Tq; }
  // keys [0, key_end) are seen by some query in [q0, q1)
  i64 key_end(i64 q1) const { return causal ? std::min(Tk, q1 + off()) : Tk; }
  // how many of the keys [k0, k0 + nk) query i sees
  i64 visible(i64 i, i64 k0, i64 nk) const {
    return causal ? std::clamp<i64>(i + off() - k0 + 1, 0, nk) : nk;
  }
};

template <typename T>
struct Heads {  // pointers to one (batch, head)'s rows
  const T *k, *kg, *v;
  Heads(const Dims& d, i64 bh, const T* k_, const T* kg_, const T* v_) {
    const i64 b = bh / d.H, h = bh % d.H;
    k = k_ + (b * d.G + h / (d.H / d.G)) * d.Tk * d.D;
    kg = kg_ + (b * d.Gg + h / (d.H / d.Gg)) * d.Tk * d.Dg;
    v = v_ + (b * d.Gv + h / (d.H / d.Gv)) * d.Tk * d.Dv;
  }
};

template <typename T>
void forward(const Dims& d, const T* q, const T* k, const T* qg, const T* kg, const T* v, const T* c,
             const T* spb, const T* gamma, T* ok, T* w0, T* lse2) {
  const i64 nqb = (d.Tq + d.bq - 1) / d.bq, tasks = d.B * d.H * nqb;
  const T qscale = T(LOG2E) / std::sqrt(T(d.D));
#pragma omp parallel num_threads(d.threads)
  {
    std::vector<T> S(d.bq * d.bk), X(d.bq * d.bk), acc(d.bq * d.Dv), qs(d.bq * d.D);
    std::vector<T> m(d.bq), l(d.bq), ex(d.bq), bias(d.bq), spb2(d.bq);
#pragma omp for schedule(dynamic, 1)
    for (i64 task = 0; task < tasks; ++task) {
      const i64 bh = task / nqb, q0 = (nqb - 1 - task % nqb) * d.bq;  // longest (causal) blocks first
      const i64 q1 = std::min(q0 + d.bq, d.Tq), nq = q1 - q0, row0 = bh * d.Tq + q0;
      const Heads<T> hd(d, bh, k, kg, v);
      const T* qgp = qg + row0 * d.Dg;
      for (i64 r = 0; r < nq; ++r) {
        const T cr = c[row0 + r];
        for (i64 e = 0; e < d.D; ++e) qs[r * d.D + e] = q[(row0 + r) * d.D + e] * cr * qscale;
        bias[r] = -T(LOG2E) * cr * gamma[row0 + r];
        spb2[r] = T(LOG2E) * spb[row0 + r];
        m[r] = l[r] = ex[r] = T(0);
      }
      std::fill(acc.begin(), acc.begin() + nq * d.Dv, T(0));
      for (i64 k0 = 0; k0 < d.key_end(q1); k0 += d.bk) {
        const i64 nk = std::min(d.bk, d.Tk - k0);
        mm<T>(false, true, nq, nk, d.D, 1, qs.data(), d.D, hd.k + k0 * d.D, d.D, 0, S.data(), d.bk);
        mm<T>(false, true, nq, nk, d.Dg, 1, qgp, d.Dg, hd.kg + k0 * d.Dg, d.Dg, 0, X.data(), d.bk);
        for (i64 r = 0; r < nq; ++r) {
          T* __restrict s = S.data() + r * d.bk;
          const T* __restrict x = X.data() + r * d.bk;
          const i64 nv = d.visible(q0 + r, k0, nk);
          const T br = bias[r], sr = spb2[r];
          T ymax = 0;
#pragma omp simd reduction(max : ymax)
          for (i64 j = 0; j < nv; ++j) {
            const T y = s[j] + br - sr * softplus_neg(x[j], neg_abs_exp(x[j]));
            s[j] = y;
            ymax = vmax(ymax, y);
          }
          const T m_new = vmax(m[r], ymax);
          if (m_new > m[r]) {
            const T f = ex2(m[r] - m_new);
            l[r] *= f;
            ex[r] *= f;
            for (i64 e = 0; e < d.Dv; ++e) acc[r * d.Dv + e] *= f;
            m[r] = m_new;
          }
          const T thr = ex2(-m_new);
          T ls = 0, es = 0;
#pragma omp simd reduction(+ : ls, es)
          for (i64 j = 0; j < nv; ++j) {
            const T p = ex2(s[j] - m_new);
            s[j] = p;
            ls += p;
            es += vmax(thr - p, T(0));
          }
          for (i64 j = nv; j < nk; ++j) s[j] = 0;
          l[r] += ls;
          ex[r] += es;
        }
        mm<T>(false, false, nq, d.Dv, nk, 1, S.data(), d.bk, hd.v + k0 * d.Dv, d.Dv, 1, acc.data(), d.Dv);
      }
      for (i64 r = 0; r < nq; ++r) {
        const T z = l[r] + ex[r];
        for (i64 e = 0; e < d.Dv; ++e) ok[(row0 + r) * d.Dv + e] = acc[r * d.Dv + e] / z;
        w0[row0 + r] = ex[r] / z;
        lse2[row0 + r] = m[r] + std::log2(z);
      }
    }
  }
}

// One task per (batch, head): the keys' gradients of a head (dk, dkg, dv, per query head) are
// accumulated by one thread without locks; grouped heads are summed by the caller.
template <typename T>
void backward(const Dims& d, const T* q, const T* k, const T* qg, const T* kg, const T* v, const T* c,
              const T* spb, const T* gamma, const T* ok, const T* w0, const T* lse2, const T* dok, const T* dw0,
              T* dq, T* dk, T* dqg, T* dkg, T* dv, T* dc, T* dspb, T* dgamma) {
  const i64 tasks = d.B * d.H;
  const T rsd = T(1) / std::sqrt(T(d.D));
#pragma omp parallel num_threads(d.threads)
  {
    std::vector<T> S(d.bq * d.bk), X(d.bq * d.bk), P(d.bq * d.bk);
    std::vector<T> qs(d.bq * d.D), qsc(d.bq * d.D), qgs(d.bq * d.Dg), dqa(d.bq * d.D), dqga(d.bq * d.Dg);
    std::vector<T> bias(d.bq), spb2(d.bq), delta(d.bq), dsum(d.bq), dsp(d.bq);
#pragma omp for schedule(dynamic, 1)
    for (i64 bh = 0; bh < tasks; ++bh) {
      const Heads<T> hd(d, bh, k, kg, v);
      T* dkh = dk + bh * d.Tk * d.D;
      T* dkgh = dkg + bh * d.Tk * d.Dg;
      T* dvh = dv + bh * d.Tk * d.Dv;
      std::fill(dkh, dkh + d.Tk * d.D, T(0));
      std::fill(dkgh, dkgh + d.Tk * d.Dg, T(0));
      std::fill(dvh, dvh + d.Tk * d.Dv, T(0));
      for (i64 q0 = 0; q0 < d.Tq; q0 += d.bq) {
        const i64 q1 = std::min(q0 + d.bq, d.Tq), nq = q1 - q0, row0 = bh * d.Tq + q0;
        const T* qgp = qg + row0 * d.Dg;
        const T* dop = dok + row0 * d.Dv;
        for (i64 r = 0; r < nq; ++r) {
          const i64 i = row0 + r;
          const T cr = c[i];
          for (i64 e = 0; e < d.D; ++e) {
            qsc[r * d.D + e] = q[i * d.D + e] * cr * rsd;
            qs[r * d.D + e] = qsc[r * d.D + e] * T(LOG2E);
          }
          for (i64 e = 0; e < d.Dg; ++e) qgs[r * d.Dg + e] = qg[i * d.Dg + e] * spb[i];
          T dot = 0;
          for (i64 e = 0; e < d.Dv; ++e) dot += dok[i * d.Dv + e] * ok[i * d.Dv + e];
          delta[r] = dot - dw0[i] * (T(1) - w0[i]);  // Delta = sum_j w_j dP_j
          bias[r] = -T(LOG2E) * cr * gamma[i];
          spb2[r] = T(LOG2E) * spb[i];
          dsum[r] = dsp[r] = T(0);
        }
        std::fill(dqa.begin(), dqa.begin() + nq * d.D, T(0));
        std::fill(dqga.begin(), dqga.begin() + nq * d.Dg, T(0));
        for (i64 k0 = 0; k0 < d.key_end(q1); k0 += d.bk) {
          const i64 nk = std::min(d.bk, d.Tk - k0);
          mm<T>(false, true, nq, nk, d.D, 1, qs.data(), d.D, hd.k + k0 * d.D, d.D, 0, S.data(), d.bk);
          mm<T>(false, true, nq, nk, d.Dg, 1, qgp, d.Dg, hd.kg + k0 * d.Dg, d.Dg, 0, X.data(), d.bk);
          mm<T>(false, true, nq, nk, d.Dv, 1, dop, d.Dv, hd.v + k0 * d.Dv, d.Dv, 0, P.data(), d.bk);
          for (i64 r = 0; r < nq; ++r) {
            T* __restrict s = S.data() + r * d.bk;
            T* __restrict x = X.data() + r * d.bk;
            T* __restrict p = P.data() + r * d.bk;
            const i64 nv = d.visible(q0 + r, k0, nk);
            const T br = bias[r], sr = spb2[r], lr = lse2[row0 + r], dwr = dw0[row0 + r], dr = delta[r];
            T ssum = 0, ssp = 0;
#pragma omp simd reduction(+ : ssum, ssp)
            for (i64 j = 0; j < nv; ++j) {
              const T g = x[j];
              const T e = neg_abs_exp(g);
              const T sp = softplus_neg(g, e);
              const T y = s[j] + br - sr * sp;
              const T w = ex2(y - lr);
              // the threshold's share: 1 above it, 0 below, 1/2 on a tie (as torch.maximum splits it)
              const T tau = y > T(0) ? T(1) : (y < T(0) ? T(0) : T(0.5));
              const T ds = w * (p[j] - dwr - dr * tau);  // dL/da
              s[j] = w;
              p[j] = ds;
              x[j] = ds * sigmoid_neg(g, e);  // dL/dg / softplus(beta)
              ssum += ds;
              ssp += ds * sp;
            }
            for (i64 j = nv; j < nk; ++j) s[j] = p[j] = x[j] = 0;
            dsum[r] += ssum;
            dsp[r] -= ssp;
          }
          mm<T>(true, false, nk, d.Dv, nq, 1, S.data(), d.bk, dop, d.Dv, 1, dvh + k0 * d.Dv, d.Dv);
          mm<T>(false, false, nq, d.D, nk, 1, P.data(), d.bk, hd.k + k0 * d.D, d.D, 1, dqa.data(), d.D);
          mm<T>(true, false, nk, d.D, nq, 1, P.data(), d.bk, qsc.data(), d.D, 1, dkh + k0 * d.D, d.D);
          mm<T>(false, false, nq, d.Dg, nk, 1, X.data(), d.bk, hd.kg + k0 * d.Dg, d.Dg, 1, dqga.data(), d.Dg);
          mm<T>(true, false, nk, d.Dg, nq, 1, X.data(), d.bk, qgs.data(), d.Dg, 1, dkgh + k0 * d.Dg, d.Dg);
        }
        for (i64 r = 0; r < nq; ++r) {
          const i64 i = row0 + r;
          T qdot = 0;
          for (i64 e = 0; e < d.D; ++e) {
            qdot += q[i * d.D + e] * dqa[r * d.D + e];
            dq[i * d.D + e] = dqa[r * d.D + e] * c[i] * rsd;
          }
          for (i64 e = 0; e < d.Dg; ++e) dqg[i * d.Dg + e] = dqga[r * d.Dg + e] * spb[i];
          dc[i] = qdot * rsd - gamma[i] * dsum[r];
          dgamma[i] = -c[i] * dsum[r];
          dspb[i] = dsp[r];
        }
      }
    }
  }
}

Dims dims(i64 B, i64 H, i64 G, i64 Gg, i64 Gv, i64 Tq, i64 Tk, i64 D, i64 Dg, i64 Dv, int causal, i64 bq, i64 bk,
          int threads) {
  return Dims{B, H, G, Gg, Gv, Tq, Tk, D, Dg, Dv, causal != 0, bq, bk, std::max(threads, 1)};
}

}  // namespace
}  // namespace attnlab

using attnlab::i64;

#define ATTNLAB_PRINCIPLED(T, SUFFIX)                                                                           \
  extern "C" int attnlab_principled_fwd_##SUFFIX(                                                              \
      const T* q, const T* k, const T* qg, const T* kg, const T* v, const T* c, const T* spb, const T* gamma,   \
      T* ok, T* w0, T* lse2, i64 B, i64 H, i64 G, i64 Gg, i64 Gv, i64 Tq, i64 Tk, i64 D, i64 Dg, i64 Dv,        \
      int causal, i64 bq, i64 bk, int threads) {                                                                \
    attnlab::forward<T>(attnlab::dims(B, H, G, Gg, Gv, Tq, Tk, D, Dg, Dv, causal, bq, bk, threads), q, k, qg, \
                        kg, v, c, spb, gamma, ok, w0, lse2);                                                    \
    return 0;                                                                                                   \
  }                                                                                                             \
  extern "C" int attnlab_principled_bwd_##SUFFIX(                                                              \
      const T* q, const T* k, const T* qg, const T* kg, const T* v, const T* c, const T* spb, const T* gamma,   \
      const T* ok, const T* w0, const T* lse2, const T* dok, const T* dw0, T* dq, T* dk, T* dqg, T* dkg, T* dv, \
      T* dc, T* dspb, T* dgamma, i64 B, i64 H, i64 G, i64 Gg, i64 Gv, i64 Tq, i64 Tk, i64 D, i64 Dg, i64 Dv,    \
      int causal, i64 bq, i64 bk, int threads) {                                                                \
    attnlab::backward<T>(attnlab::dims(B, H, G, Gg, Gv, Tq, Tk, D, Dg, Dv, causal, bq, bk, threads), q, k, qg, \
                         kg, v, c, spb, gamma, ok, w0, lse2, dok, dw0, dq, dk, dqg, dkg, dv, dc, dspb, dgamma);  \
    return 0;                                                                                                   \
  }

ATTNLAB_PRINCIPLED(float, f32)
ATTNLAB_PRINCIPLED(double, f64)
