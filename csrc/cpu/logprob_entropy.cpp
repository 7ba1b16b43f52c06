// Fused log-prob + entropy statistics and their gradient on the CPU: OpenMP over rows, SIMD over the vocabulary.
// Nothing of size [N, V] is allocated: each row is read twice (max, then sums) while it sits in L2.
// The row functions are compiled for AVX-512, AVX2 and baseline x86-64 (target_clones, picked at load time).
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MPPO_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MPPO_CLONES
#endif

namespace mppo_cpu {
namespace {

constexpr float kExpLow = -87.33654475f;  // exp() of anything lower is below FLT_MIN: flushed to 0
constexpr int64_t kBlock = 4096;          // fp32 partial sums per block, blocks summed in double

inline float load_f(const float* p, int64_t i) { return p[i]; }
// bf16 <-> float with __builtin_bit_cast (GCC vectorises these; the union form in dtype.h it does not).
inline float load_f(const uint16_t* p, int64_t i) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(p[i]) << 16);
}
inline void store_f(float* p, int64_t i, float x) { p[i] = x; }
inline void store_f(uint16_t* p, int64_t i, float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  p[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// exp(x) for x < 88 (Cephes expf: Cody-Waite reduction + degree-6 polynomial, ~1 ulp), branch-free so that it
// vectorises; no libm call. x < -87.3 (and -inf) -> 0, NaN -> NaN.
inline __attribute__((always_inline)) float exp_f(float x) {
  const float xc = x < kExpLow ? kExpLow : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits
  const float shifted = xc * 1.44269504088896341f + magic;
  const float k = shifted - magic;
  const int32_t ki = __builtin_bit_cast(int32_t, shifted) - __builtin_bit_cast(int32_t, magic);
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = __builtin_bit_cast(float, (ki + 127) << 23);
  return x < kExpLow ? 0.0f : y * scale;
}

// bf16 blocks are first widened into a float buffer: GCC vectorises the widening loop and the float math loop
// separately (fused, it picks 16-bit vector modes and runs ~7x slower).
inline const float* as_float(const float* x, int64_t start, int64_t stop, float* /*buf*/) { return x + start; }
inline const float* as_float(const uint16_t* x, int64_t start, int64_t stop, float* buf) {
  for (int64_t j = start; j < stop; ++j) buf[j - start] = load_f(x, j);
  return buf;
}
inline void from_float(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void from_float(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; ++j) store_f(dst, j, src[j]);
}

template <typename T>
inline __attribute__((always_inline)) void row_stats(const T* x, int64_t vocab, float* max_out, double* sum_exp,
                                                     double* sum_exp_shifted) {
  float m = -std::numeric_limits<float>::infinity();
  int32_t n_nan = 0;
#pragma omp simd reduction(max : m) reduction(+ : n_nan)
  for (int64_t j = 0; j < vocab; ++j) {
    const float v = load_f(x, j);
    m = v > m ? v : m;
    n_nan += v != v;
  }
  if (n_nan) m = std::numeric_limits<float>::quiet_NaN();  // NaN anywhere in the row -> NaN statistics
  *max_out = m;
  if (m == -std::numeric_limits<float>::infinity()) {  // empty or all -inf shard row: contributes nothing
    *sum_exp = 0.0;
    *sum_exp_shifted = 0.0;
    return;
  }
  alignas(64) float buf[kBlock];
  double s_total = 0.0, w_total = 0.0;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t n = start + kBlock < vocab ? kBlock : vocab - start;
    const float* xs = as_float(x, start, start + n, buf);
    float s = 0.0f, w = 0.0f;
#pragma omp simd reduction(+ : s, w)
    for (int64_t j = 0; j < n; ++j) {
      const float d = xs[j] - m;
      const float e = exp_f(d);
      s += e;
      w += e * (d < kExpLow ? kExpLow : d);  // e == 0 there; avoids 0 * -inf
    }
    s_total += s;
    w_total += w;
  }
  *sum_exp = s_total;
  *sum_exp_shifted = w_total;
}

MPPO_CLONES void row_stats_f32(const float* x, int64_t v, float* m, double* s, double* w) { row_stats(x, v, m, s, w); }
MPPO_CLONES void row_stats_bf16(const uint16_t* x, int64_t v, float* m, double* s, double* w) {
  row_stats(x, v, m, s, w);
}

template <typename T>
inline __attribute__((always_inline)) void row_grad(const T* x, int64_t vocab, float log_z, float entropy,
                                                    float g_lp, float g_ent, T* grad) {
  const float shift = entropy - log_z;  // x - log_z + H = x + shift
  alignas(64) float in[kBlock];
  alignas(64) float out[kBlock];
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t n = start + kBlock < vocab ? kBlock : vocab - start;
    const float* xs = as_float(x, start, start + n, in);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float p = exp_f(xs[j] - log_z);
      out[j] = p == 0.0f ? 0.0f : -p * (g_lp + g_ent * (xs[j] + shift));
    }
    from_float(out, n, grad + start);
  }
}

MPPO_CLONES void row_grad_f32(const float* x, int64_t v, float lz, float h, float glp, float gent, float* g) {
  row_grad(x, v, lz, h, glp, gent, g);
}
MPPO_CLONES void row_grad_bf16(const uint16_t* x, int64_t v, float lz, float h, float glp, float gent, uint16_t* g) {
  row_grad(x, v, lz, h, glp, gent, g);
}

// The target element gets + g_lp; recomputed in one expression so that bf16 output is rounded once.
template <typename T>
inline void add_target_grad(const T* x, int64_t local, float log_z, float entropy, float g_lp, float g_ent, T* grad) {
  const float xj = load_f(x, local);
  const float p = exp_f(xj - log_z);
  const float g = (p == 0.0f ? 0.0f : -p * (g_lp + g_ent * (xj - log_z + entropy))) + g_lp;
  store_f(grad, local, g);
}

template <typename T>
void partials_low_precision(const T* logits, int64_t n_rows, int64_t vocab, int64_t row_stride, const int64_t* target,
                            int64_t vocab_start, float* out) {
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < n_rows; ++n) {
    const T* x = logits + n * row_stride;
    float m;
    double s, w;
    if constexpr (sizeof(T) == 4) row_stats_f32(x, vocab, &m, &s, &w);
    else row_stats_bf16(x, vocab, &m, &s, &w);
    const int64_t local = target[n] - vocab_start;
    out[n] = m;
    out[n_rows + n] = static_cast<float>(s);
    out[2 * n_rows + n] = static_cast<float>(w);
    out[3 * n_rows + n] = (local >= 0 && local < vocab) ? load_f(x, local) : 0.0f;
  }
}

void partials_f64(const double* logits, int64_t n_rows, int64_t vocab, int64_t row_stride, const int64_t* target,
                  int64_t vocab_start, double* out) {
  const double neg_inf = -std::numeric_limits<double>::infinity();
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < n_rows; ++n) {
    const double* x = logits + n * row_stride;
    double m = neg_inf;
    bool nan = false;
    for (int64_t j = 0; j < vocab; ++j) {
      m = x[j] > m ? x[j] : m;
      nan |= x[j] != x[j];
    }
    if (nan) m = std::numeric_limits<double>::quiet_NaN();
    double s = 0.0, w = 0.0;
    if (m != neg_inf) {
      for (int64_t j = 0; j < vocab; ++j) {
        const double d = x[j] - m;
        const double e = std::exp(d);
        s += e;
        w += e == 0.0 ? 0.0 : e * d;
      }
    }
    const int64_t local = target[n] - vocab_start;
    out[n] = m;
    out[n_rows + n] = s;
    out[2 * n_rows + n] = w;
    out[3 * n_rows + n] = (local >= 0 && local < vocab) ? x[local] : 0.0;
  }
}

template <typename T>
void backward_low_precision(const T* logits, int64_t n_rows, int64_t vocab, int64_t row_stride, const int64_t* target,
                            int64_t vocab_start, const float* log_z, const float* entropy, const float* g_lp,
                            const float* g_ent, T* grad) {
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < n_rows; ++n) {
    const T* x = logits + n * row_stride;
    T* g = grad + n * vocab;
    if constexpr (sizeof(T) == 4) row_grad_f32(x, vocab, log_z[n], entropy[n], g_lp[n], g_ent[n], g);
    else row_grad_bf16(x, vocab, log_z[n], entropy[n], g_lp[n], g_ent[n], g);
    const int64_t local = target[n] - vocab_start;
    if (local >= 0 && local < vocab) add_target_grad(x, local, log_z[n], entropy[n], g_lp[n], g_ent[n], g);
  }
}

void backward_f64(const double* logits, int64_t n_rows, int64_t vocab, int64_t row_stride, const int64_t* target,
                  int64_t vocab_start, const double* log_z, const double* entropy, const double* g_lp,
                  const double* g_ent, double* grad) {
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < n_rows; ++n) {
    const double* x = logits + n * row_stride;
    double* g = grad + n * vocab;
    const int64_t local = target[n] - vocab_start;
    for (int64_t j = 0; j < vocab; ++j) {
      const double p = std::exp(x[j] - log_z[n]);
      const double term = p == 0.0 ? 0.0 : -p * (g_lp[n] + g_ent[n] * (x[j] - log_z[n] + entropy[n]));
      g[j] = term + (j == local ? g_lp[n] : 0.0);
    }
  }
}

}  // namespace

void lse_partials(const void* logits, mppo_dtype dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
                  const int64_t* target, int64_t vocab_start, void* out) {
  switch (dtype) {
    case MPPO_F32:
      return partials_low_precision(static_cast<const float*>(logits), n_rows, vocab, row_stride, target, vocab_start,
                                    static_cast<float*>(out));
    case MPPO_BF16:
      return partials_low_precision(static_cast<const uint16_t*>(logits), n_rows, vocab, row_stride, target,
                                    vocab_start, static_cast<float*>(out));
    case MPPO_F64:
      return partials_f64(static_cast<const double*>(logits), n_rows, vocab, row_stride, target, vocab_start,
                          static_cast<double*>(out));
    default: return;
  }
}

void lse_backward(const void* logits, mppo_dtype dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
                  const int64_t* target, int64_t vocab_start, const void* log_z, const void* entropy,
                  const void* grad_logp, const void* grad_entropy, void* grad_logits) {
  switch (dtype) {
    case MPPO_F32:
      return backward_low_precision(static_cast<const float*>(logits), n_rows, vocab, row_stride, target, vocab_start,
                                    static_cast<const float*>(log_z), static_cast<const float*>(entropy),
                                    static_cast<const float*>(grad_logp), static_cast<const float*>(grad_entropy),
                                    static_cast<float*>(grad_logits));
    case MPPO_BF16:
      return backward_low_precision(static_cast<const uint16_t*>(logits), n_rows, vocab, row_stride, target,
                                    vocab_start, static_cast<const float*>(log_z), static_cast<const float*>(entropy),
                                    static_cast<const float*>(grad_logp), static_cast<const float*>(grad_entropy),
                                    static_cast<uint16_t*>(grad_logits));
    case MPPO_F64:
      return backward_f64(static_cast<const double*>(logits), n_rows, vocab, row_stride, target, vocab_start,
                          static_cast<const double*>(log_z), static_cast<const double*>(entropy),
                          static_cast<const double*>(grad_logp), static_cast<const double*>(grad_entropy),
                          static_cast<double*>(grad_logits));
    default: return;
  }
}

}  // namespace mppo_cpu
