// Windowed scalar / hybrid attention on the CPU (docs/mechanisms.md, "Windowed decoding for a whole sequence"):
// the selection of each query's k nearest keys in scalar space, and attention over the selected
// keys only, forward and backward. Work O(T (k + w)) per head after one O(T log T) sort; no T x T
// pass anywhere.
//
// Selection. Query t's candidates are the keys lo <= s <= t - local of its document (lo: the
// document's start or the prefix); it keeps the k with the smallest |qs_t - ks_s|, the newest
// first among equal distances (the rule of `window.window_mask`). Per head and document, the
// candidate keys are sorted twice by value: ascending position within equal values (order L) and
// descending (order R). Queries run from the last to the first, so a key stops being a candidate
// once (one deletion) and is never added. The keys below qs_t, walked down order L, come in
// ascending distance and, within equal values, newest first; the keys >= qs_t walked up order R
// likewise. Merging the two streams by (distance, newest) gives exactly the dense rule's order.
// Skipping deleted keys: "nearest alive at or below / above" as union-find with path halving.
//
// Attention. Each query scores its m selected keys (idx / ok, columns that hold no key skipped,
// and keys after the query, as prefix columns of early queries are), softmax over them, reads
// their values. The backward pass recomputes the scores from the saved log-sum-exp and adds
// every key-side gradient into per-head buffers: a head is one task, so nothing is shared
// between threads and no atomics are needed; the caller sums heads to their key/value groups.
//
// Layouts: qs, ks, tau (BH, T); q, k (BH, T, D); v, o (BH, T, Dv); idx, ok (BH, T, m);
// seg (B, T) or null; lam (H) or null.
#include "common.h"

#include <numeric>

namespace attnlab {
namespace {

// Largest alive index <= x (indices shifted by one; 0 is a sentinel that is always alive).
inline int32_t find_down(std::vector<int32_t>& par, int32_t x) {
  while (par[x] != x) {
    par[x] = par[par[x]];
    x = par[x];
  }
  return x;
}

template <typename T>
struct Selector {  // scratch of one thread
  std::vector<int32_t> ordL, ordR, rankL, rankR, down, up;
  std::vector<T> val;

  // Queries t0 .. t1 - 1 of one head, their candidates lo .. t - local (lo >= t0, same document).
  void segment(const T* qs, const T* ks, int64_t* idx, uint8_t* ok, i64 t0, i64 t1, i64 lo, i64 local, i64 k) {
    const i64 hi = t1 - 1 - local;  // the last key any of these queries may select
    const i64 N = hi - lo + 1;
    if (N <= 0) return;
    ordL.resize(N), ordR.resize(N), rankL.resize(N), rankR.resize(N), val.resize(N);
    std::iota(ordL.begin(), ordL.end(), 0);
    std::stable_sort(ordL.begin(), ordL.end(), [&](int32_t a, int32_t b) { return ks[lo + a] < ks[lo + b]; });
    // order R: each run of equal values reversed
    ordR = ordL;
    for (i64 a = 0; a < N;) {
      i64 b = a + 1;
      while (b < N && ks[lo + ordL[b]] == ks[lo + ordL[a]]) ++b;
      std::reverse(ordR.begin() + a, ordR.begin() + b);
      a = b;
    }
    for (i64 r = 0; r < N; ++r) rankL[ordL[r]] = (int32_t)r, rankR[ordR[r]] = (int32_t)r, val[r] = ks[lo + ordL[r]];
    // down: order L shifted by one (0 = none below); up: order R mirrored the same way, so that
    // "nearest alive above r" is find_down on index N - r.
    down.resize(N + 1), up.resize(N + 1);
    std::iota(down.begin(), down.end(), 0);
    std::iota(up.begin(), up.end(), 0);
    for (i64 t = t1 - 1; t >= t0; --t) {
      const i64 last = t - local;  // candidates lo .. last
      if (last < lo) break;
      const T q = qs[t];
      const i64 p = std::lower_bound(val.begin(), val.end(), q) - val.begin();  // first value >= q
      int32_t l = find_down(down, (int32_t)p);          // alive in order L at rank l - 1 < p
      int32_t u = find_down(up, (int32_t)(N - p));     // alive in order R at rank N - u >= p
      int64_t* it = idx + t * k;
      uint8_t* ot = ok + t * k;
      for (i64 j = 0; j < k; ++j) {
        const bool has_l = l > 0, has_u = u > 0;
        if (!has_l && !has_u) break;
        i64 pos;
        if (has_l && has_u) {
          const i64 pl = lo + ordL[l - 1], pu = lo + ordR[N - u];
          const T dl = q - ks[pl], du = ks[pu] - q;
          if (dl < du || (dl == du && pl > pu)) pos = pl, l = find_down(down, l - 1);
          else pos = pu, u = find_down(up, u - 1);
        } else if (has_l) {
          pos = lo + ordL[l - 1], l = find_down(down, l - 1);
        } else {
          pos = lo + ordR[N - u], u = find_down(up, u - 1);
        }
        it[j] = pos, ot[j] = 1;
      }
      // key `last` is no candidate of query t - 1
      down[rankL[last - lo] + 1] = rankL[last - lo];
      up[N - rankR[last - lo]] = (int32_t)(N - rankR[last - lo] - 1);
    }
  }
};

template <typename T>
void select(const T* qs, const T* ks, const int64_t* seg, int64_t* idx, uint8_t* ok, i64 B, i64 H, i64 Tn, i64 k,
            i64 n_prefix, i64 local, int threads) {
  std::fill(idx, idx + B * H * Tn * k, 0);
  std::fill(ok, ok + B * H * Tn * k, 0);
#pragma omp parallel num_threads(threads)
  {
    Selector<T> s;
#pragma omp for schedule(dynamic, 1)
    for (i64 bh = 0; bh < B * H; ++bh) {
      const i64 b = bh / H;
      const T* q = qs + bh * Tn;
      const T* kk = ks + bh * Tn;
      int64_t* it = idx + bh * Tn * k;
      uint8_t* ot = ok + bh * Tn * k;
      if (seg == nullptr) {
        s.segment(q, kk, it, ot, 0, Tn, n_prefix, local, k);
        continue;
      }
      const int64_t* sg = seg + b * Tn;
      for (i64 t0 = 0; t0 < Tn;) {  // one document: a run of equal ids
        i64 t1 = t0 + 1;
        while (t1 < Tn && sg[t1] == sg[t0]) ++t1;
        s.segment(q, kk, it, ot, t0, t1, t0, local, k);
        t0 = t1;
      }
    }
  }
}

struct Dims {
  i64 BH, H, Tn, m, D, Dv;
  bool cauchy;
  int threads;
};

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, i64 n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (i64 i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// log(1 + x) for x >= 0. float: 1 + x = 2^e m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s),
// s = (m - 1) / (m + 1), |s| <= 0.172, the series to s^9 (error ~1e-9 relative to log m), plus
// e log 2: an absolute error near float rounding of 1 + x, which is what a logit needs. double: libm.
inline float log1p_pos(float x) {
  const float y = 1.0f + x;
  int32_t bits = bitcast<int32_t>(y);
  int32_t e = ((bits >> 23) & 0xff) - 127;
  bits = (bits & 0x007fffff) | 0x3f800000;  // m in [1, 2)
  float m = bitcast<float>(bits);
  const bool big = m > 1.41421356f;
  m = big ? 0.5f * m : m;
  e = big ? e + 1 : e;
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float p = 2.0f / 9;
  p = p * s2 + 2.0f / 7;
  p = p * s2 + 2.0f / 5;
  p = p * s2 + 2.0f / 3;
  p = p * s2 + 2.0f;
  return s * p + (float)e * 0.69314718055994531f;
}

inline double log1p_pos(double x) { return std::log1p(x); }

template <typename T>
inline T exp_(T x) { return ex2(x * T(LOG2E)); }

inline double exp_(double x) { return std::exp(x); }

// The scalar term lam * phi(x), x = (qs - ks)^2 / tau, phi = -x or -log(1 + x); dphi = phi'(x).
template <typename T>
inline T phi(T x, bool cauchy) { return cauchy ? -log1p_pos(x) : -x; }

template <typename T>
inline T dphi(T x, bool cauchy) { return cauchy ? T(-1) / (T(1) + x) : T(-1); }

template <typename T>
struct Scores {  // one query's scores over its selected keys (j < n valid entries: key pos[j], column col[j])
  std::vector<T> s, x, p;
  std::vector<i64> pos, col;
  i64 n = 0;

  void compute(const Dims& d, i64 bh, i64 t, const T* qs, const T* ks, const T* tau, const T* lam, const T* q,
               const T* k, const int64_t* idx, const uint8_t* ok, T scale) {
    s.resize(d.m), x.resize(d.m), p.resize(d.m), pos.resize(d.m), col.resize(d.m);
    const i64 row = bh * d.Tn + t;
    const T qt = qs[row], it = T(1) / tau[row], l = lam ? lam[bh % d.H] : T(1);
    n = 0;
    for (i64 j = 0; j < d.m; ++j) {  // the valid columns, compacted
      const i64 sj = idx[row * d.m + j];
      if (!ok[row * d.m + j] || sj > t) continue;
      const T diff = qt - ks[bh * d.Tn + sj];
      pos[n] = sj, col[n] = j, x[n] = diff * diff * it;
      ++n;
    }
    T* __restrict sp = s.data();
    const T* __restrict xp = x.data();
    if (d.cauchy) {  // separate loops over the compacted scores, so that each vectorizes
#pragma omp simd
      for (i64 j = 0; j < n; ++j) sp[j] = l * phi(xp[j], true);
    } else {
#pragma omp simd
      for (i64 j = 0; j < n; ++j) sp[j] = -l * xp[j];
    }
    if (q)
      for (i64 j = 0; j < n; ++j) sp[j] += dot(q + row * d.D, k + (bh * d.Tn + pos[j]) * d.D, d.D) * scale;
  }
};

template <typename T>
void attn_fwd(const Dims& d, const T* qs, const T* ks, const T* tau, const T* lam, const T* q, const T* k,
              const T* v, const int64_t* idx, const uint8_t* ok, T* o, T* w) {
  const T scale = d.D ? T(1) / std::sqrt(T(d.D)) : T(0);
#pragma omp parallel num_threads(d.threads)
  {
    Scores<T> sc;
#pragma omp for schedule(dynamic, 1)
    for (i64 bh = 0; bh < d.BH; ++bh) {
      for (i64 t = 0; t < d.Tn; ++t) {
        sc.compute(d, bh, t, qs, ks, tau, lam, q, k, idx, ok, scale);
        const i64 row = bh * d.Tn + t;
        T* ot = o + row * d.Dv;
        T* wt = w + row * d.m;
        std::fill(ot, ot + d.Dv, T(0));
        std::fill(wt, wt + d.m, T(0));
        if (sc.n == 0) continue;  // no key: a zero row (the ops give every query at least its own key)
        T mx = sc.s[0];
        for (i64 j = 1; j < sc.n; ++j) mx = vmax(mx, sc.s[j]);
        T sum = 0;
        T* __restrict pp = sc.p.data();
        const T* __restrict sp = sc.s.data();
#pragma omp simd reduction(+ : sum)
        for (i64 j = 0; j < sc.n; ++j) sum += (pp[j] = exp_(sp[j] - mx));
        const T inv = T(1) / sum;
        for (i64 j = 0; j < sc.n; ++j) {
          const T wj = sc.p[j] * inv;
          wt[sc.col[j]] = wj;
          const T* __restrict vs = v + (bh * d.Tn + sc.pos[j]) * d.Dv;
#pragma omp simd
          for (i64 e = 0; e < d.Dv; ++e) ot[e] += wj * vs[e];
        }
      }
    }
  }
}

// Gradients from the forward's weights w (BH, T, m), 0 where a column holds no key (a weight that
// underflowed to 0 has zero gradients too): dqs, dtau (BH, T) and dq (BH, T, D) per query; dks (BH, T),
// dk (BH, T, D), dv (BH, T, Dv) per head (summed to groups by the caller); dlam (BH) per head and batch
// row (summed by the caller), or null.
template <typename T>
void attn_bwd(const Dims& d, const T* qs, const T* ks, const T* tau, const T* lam, const T* q, const T* k,
              const T* v, const int64_t* idx, const T* o, const T* w, const T* dout, T* dqs, T* dks, T* dtau,
              T* dlam, T* dq, T* dk, T* dv) {
  const T scale = d.D ? T(1) / std::sqrt(T(d.D)) : T(0);
#pragma omp parallel for num_threads(d.threads) schedule(dynamic, 1)
  for (i64 bh = 0; bh < d.BH; ++bh) {
    std::fill(dks + bh * d.Tn, dks + (bh + 1) * d.Tn, T(0));
    std::fill(dv + bh * d.Tn * d.Dv, dv + (bh + 1) * d.Tn * d.Dv, T(0));
    if (q) std::fill(dk + bh * d.Tn * d.D, dk + (bh + 1) * d.Tn * d.D, T(0));
    const T l = lam ? lam[bh % d.H] : T(1);
    T dl = 0;
    for (i64 t = 0; t < d.Tn; ++t) {
      const i64 row = bh * d.Tn + t;
      const T* __restrict g = dout + row * d.Dv;
      const T delta = dot(g, o + row * d.Dv, d.Dv);
      const T qt = qs[row], it = T(1) / tau[row];
      T dqt = 0, dtt = 0;
      T* __restrict dqr = q ? dq + row * d.D : nullptr;
      if (q) std::fill(dqr, dqr + d.D, T(0));
      for (i64 j = 0; j < d.m; ++j) {
        const T p = w[row * d.m + j];
        if (p == T(0)) continue;
        const i64 krow = bh * d.Tn + idx[row * d.m + j];
        const T* __restrict vs = v + krow * d.Dv;
        T* __restrict dvs = dv + krow * d.Dv;
        const T ds = p * (dot(g, vs, d.Dv) - delta);
#pragma omp simd
        for (i64 e = 0; e < d.Dv; ++e) dvs[e] += p * g[e];
        // scalar term: lam phi(x), x = diff^2 / tau
        const T diff = qt - ks[krow];
        const T x = diff * diff * it;
        const T gx = ds * l * dphi(x, d.cauchy);
        const T gd = gx * T(2) * diff * it;
        dqt += gd;
        dks[krow] -= gd;
        dtt -= gx * x * it;
        if (dlam) dl += ds * phi(x, d.cauchy);
        if (q) {
          const T* __restrict kr = k + krow * d.D;
          const T* __restrict qr = q + row * d.D;
          T* __restrict dkr = dk + krow * d.D;
          const T c = ds * scale;
#pragma omp simd
          for (i64 e = 0; e < d.D; ++e) {
            dqr[e] += c * kr[e];
            dkr[e] += c * qr[e];
          }
        }
      }
      dqs[row] = dqt;
      dtau[row] = dtt;
    }
    if (dlam) dlam[bh] = dl;
  }
}

}  // namespace
}  // namespace attnlab

using attnlab::i64;

#define ATTNLAB_WINDOW(T, SUFFIX)                                                                               \
  extern "C" int attnlab_window_select_##SUFFIX(const T* qs, const T* ks, const int64_t* seg, int64_t* idx,      \
                                                uint8_t* ok, i64 B, i64 H, i64 Tn, i64 k, i64 n_prefix,         \
                                                i64 local, int threads) {                                      \
    attnlab::select<T>(qs, ks, seg, idx, ok, B, H, Tn, k, n_prefix, local, std::max(threads, 1));              \
    return 0;                                                                                                  \
  }                                                                                                            \
  extern "C" int attnlab_window_fwd_##SUFFIX(const T* qs, const T* ks, const T* tau, const T* lam, const T* q,   \
                                             const T* k, const T* v, const int64_t* idx, const uint8_t* ok,      \
                                             T* o, T* w, i64 BH, i64 H, i64 Tn, i64 m, i64 D, i64 Dv,          \
                                             int cauchy, int threads) {                                        \
    attnlab::attn_fwd<T>({BH, H, Tn, m, D, Dv, cauchy != 0, std::max(threads, 1)}, qs, ks, tau, lam, q, k, v,   \
                         idx, ok, o, w);                                                                     \
    return 0;                                                                                                  \
  }                                                                                                            \
  extern "C" int attnlab_window_bwd_##SUFFIX(const T* qs, const T* ks, const T* tau, const T* lam, const T* q,   \
                                             const T* k, const T* v, const int64_t* idx, const T* o,             \
                                             const T* w, const T* dout, T* dqs, T* dks, T* dtau,                \
                                             T* dlam, T* dq, T* dk, T* dv, i64 BH, i64 H, i64 Tn, i64 m, i64 D,  \
                                             i64 Dv, int cauchy, int threads) {                                \
    attnlab::attn_bwd<T>({BH, H, Tn, m, D, Dv, cauchy != 0, std::max(threads, 1)}, qs, ks, tau, lam, q, k, v,   \
                         idx, o, w, dout, dqs, dks, dtau, dlam, dq, dk, dv);                             \
    return 0;                                                                                                  \
  }

ATTNLAB_WINDOW(float, f32)
ATTNLAB_WINDOW(double, f64)
