// Shared pieces of attnlab's CPU kernels: row-major GEMM on the BLAS that libtorch links, and the
// elementwise functions the kernels apply to every score (exp2, log(1 + e), softplus).
//
// The kernels have a plain C interface (raw pointers and sizes) and include no torch header, so
// that a cold build takes a few seconds; the Python side checks every argument before a call.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

extern "C" {
// Fortran BLAS, as exported by libtorch_cpu (MKL or OpenBLAS): column-major, 32-bit sizes.
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace attnlab {

using i64 = int64_t;

// The bits of x as a To (std::bit_cast is C++20; torch builds extensions as C++17 up to 2.11).
template <typename To, typename From>
inline To bitcast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bitcast between types of one size");
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

constexpr double LOG2E = 1.4426950408889634;

inline void blas(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

inline void blas(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Row-major C (m x n) = alpha op(A) op(B) + beta C, op(X) = X^T when its flag is set.
// A row-major matrix is its transpose in column-major order, so this is C^T = op(B)^T op(A)^T.
template <typename T>
inline void mm(bool ta, bool tb, i64 m, i64 n, i64 k, T alpha, const T* A, i64 lda, const T* B, i64 ldb, T beta,
               T* C, i64 ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (i64 i = 0; i < m; ++i)
      for (i64 j = 0; j < n; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  blas(tb ? 'T' : 'N', ta ? 'T' : 'N', (int)n, (int)m, (int)k, alpha, B, (int)std::max<i64>(ldb, 1), A,
       (int)std::max<i64>(lda, 1), beta, C, (int)std::max<i64>(ldc, 1));
}

// 2^x. float: round-to-nearest range reduction and the degree-7 Taylor polynomial of 2^f on
// |f| <= 1/2 (relative error ~1e-7, near float rounding); exactly 0 below -126 (no subnormals,
// which CPUs process slowly). Branch-free (with -fno-trapping-math the selects need no branches),
// so that loops over it vectorize. double: libm.
inline float ex2(float x) {
  float xc = x < -126.0f ? -126.0f : x;
  xc = xc > 126.0f ? 126.0f : xc;
  const int32_t biased = (int32_t)(xc + 127.5f);  // round(xc) + 127, truncating a positive number
  const float f = xc - (float)(biased - 127);
  float p = 1.5252733804059840e-05f;
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  return x < -126.0f ? 0.0f : p * bitcast<float>(biased << 23);
}

inline double ex2(double x) { return std::exp2(x); }

// log(1 + e) for 0 <= e <= 1. float: 2 atanh(s) with s = e / (2 + e) <= 1/3, the series to s^13
// (relative error ~1e-8). double: libm.
inline float log1p_unit(float e) {
  const float s = e / (2.0f + e);
  const float s2 = s * s;
  float p = 2.0f / 13;
  p = p * s2 + 2.0f / 11;
  p = p * s2 + 2.0f / 9;
  p = p * s2 + 2.0f / 7;
  p = p * s2 + 2.0f / 5;
  p = p * s2 + 2.0f / 3;
  p = p * s2 + 2.0f;
  return s * p;
}

inline double log1p_unit(double e) { return std::log1p(e); }

// Branch-free max / min by value: std::max and std::min return references, and taking the
// address of a temporary keeps GCC from vectorizing an `omp simd` loop.
template <typename T>
inline T vmax(T a, T b) { return a > b ? a : b; }

// softplus(-g) = max(-g, 0) + log(1 + e) with e = exp(-|g|) = 2^(-|g| log2 e); the backward pass
// gets sigmoid(-g) from the same e: 1 / (1 + e) for g <= 0, e / (1 + e) above.
template <typename T>
inline T neg_abs_exp(T g) { return ex2((g > T(0) ? -g : g) * T(LOG2E)); }

template <typename T>
inline T softplus_neg(T g, T e) { return vmax(-g, T(0)) + log1p_unit(e); }

template <typename T>
inline T sigmoid_neg(T g, T e) { return (g <= T(0) ? T(1) : e) / (T(1) + e); }

}  // namespace attnlab
