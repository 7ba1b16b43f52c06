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
inline __attribute__((always_inline)) void row_stats(const T* x, int64_t vocab, float scale, float* max_out,
                                                     double* sum_exp, double* sum_exp_shifted) {
  float m = -std::numeric_limits<float>::infinity();
  int32_t n_nan = 0;
#pragma omp simd reduction(max : m) reduction(+ : n_nan)
  for (int64_t j = 0; j < vocab; ++j) {
    const float v = load_f(x, j);
    m = v > m ? v : m;
    n_nan += v != v;
  }
  if (n_nan) m = std::numeric_limits<float>::quiet_NaN();  // NaN anywhere in the row -> NaN statistics
  m *= scale;                                             // scale > 0: max of the scaled row
  *max_out = m;
  if (m == -std::numeric_limits<float>::infinity()) {  // all -inf shard row: contributes nothing
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
      const float d = xs[j] * scale - m;
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

MPPO_CLONES void row_stats_f32(const float* x, int64_t v, float t, float* m, double* s, double* w) {
  row_stats(x, v, t, m, s, w);
}
MPPO_CLONES void row_stats_bf16(const uint16_t* x, int64_t v, float t, float* m, double* s, double* w) {
  row_stats(x, v, t, m, s, w);
}

// grad_j = scale * -p_j (g_lp + g_ent (x_j - log_z + H)) with x_j = scale * logit_j (the target term is added after)
template <typename T>
inline __attribute__((always_inline)) void row_grad(const T* x, int64_t vocab, float scale, float log_z,
                                                    float entropy, float g_lp, float g_ent, T* grad) {
  const float shift = entropy - log_z;  // x - log_z + H = x + shift
  alignas(64) float in[kBlock];
  alignas(64) float out[kBlock];
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t n = start + kBlock < vocab ? kBlock : vocab - start;
    const float* xs = as_float(x, start, start + n, in);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float xj = xs[j] * scale;
      const float p = exp_f(xj - log_z);
      out[j] = p == 0.0f ? 0.0f : -scale * p * (g_lp + g_ent * (xj + shift));
    }
    from_float(out, n, grad + start);
  }
}

MPPO_CLONES void row_grad_f32(const float* x, int64_t v, float t, float lz, float h, float glp, float gent, float* g) {
  row_grad(x, v, t, lz, h, glp, gent, g);
}
MPPO_CLONES void row_grad_bf16(const uint16_t* x, int64_t v, float t, float lz, float h, float glp, float gent,
                               uint16_t* g) {
  row_grad(x, v, t, lz, h, glp, gent, g);
}

// The target element gets + scale * g_lp; recomputed in one expression so that bf16 output is rounded once. Takes
// the target logit read *before* the row was written, so that grad may alias the logits (in-place backward).
template <typename T>
inline void set_target_grad(float x_target, int64_t local, float scale, float log_z, float entropy, float g_lp,
                            float g_ent, T* grad) {
  const float xt = x_target * scale;
  const float p = exp_f(xt - log_z);
  const float g = scale * ((p == 0.0f ? 0.0f : -p * (g_lp + g_ent * (xt - log_z + entropy))) + g_lp);
  store_f(grad, local, g);
}

template <typename T>
void partials_low_precision(const mppo_logits& in, float* out) {
  const T* logits = static_cast<const T*>(in.data);
  const int64_t n_rows = in.n_rows, vocab = in.vocab;
  const float scale = static_cast<float>(in.inv_temperature);
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < n_rows; ++n) {
    const T* x = logits + n * in.row_stride;
    float m;
    double s, w;
    if constexpr (sizeof(T) == 4) row_stats_f32(x, vocab, scale, &m, &s, &w);
    else row_stats_bf16(x, vocab, scale, &m, &s, &w);
    const int64_t local = in.target[n] - in.vocab_start;
    out[n] = m;
    out[n_rows + n] = static_cast<float>(s);
    out[2 * n_rows + n] = static_cast<float>(w);
    out[3 * n_rows + n] = (local >= 0 && local < vocab) ? load_f(x, local) * scale : 0.0f;
  }
}

void partials_f64(const mppo_logits& in, double* out) {
  const double* logits = static_cast<const double*>(in.data);
  const int64_t n_rows = in.n_rows, vocab = in.vocab;
  const double scale = in.inv_temperature, neg_inf = -std::numeric_limits<double>::infinity();
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < n_rows; ++n) {
    const double* x = logits + n * in.row_stride;
    double m = neg_inf;
    bool nan = false;
    for (int64_t j = 0; j < vocab; ++j) {
      m = x[j] > m ? x[j] : m;
      nan |= x[j] != x[j];
    }
    m = nan ? std::numeric_limits<double>::quiet_NaN() : m * scale;
    double s = 0.0, w = 0.0;
    if (m != neg_inf) {
      for (int64_t j = 0; j < vocab; ++j) {
        const double d = x[j] * scale - m;
        const double e = std::exp(d);
        s += e;
        w += e == 0.0 ? 0.0 : e * d;
      }
    }
    const int64_t local = in.target[n] - in.vocab_start;
    out[n] = m;
    out[n_rows + n] = s;
    out[2 * n_rows + n] = w;
    out[3 * n_rows + n] = (local >= 0 && local < vocab) ? x[local] * scale : 0.0;
  }
}

template <typename T>
void backward_low_precision(const mppo_logits& in, const float* log_z, const float* entropy, const float* g_lp,
                            const float* g_ent, T* grad, int64_t grad_row_stride) {
  const T* logits = static_cast<const T*>(in.data);
  const float scale = static_cast<float>(in.inv_temperature);
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < in.n_rows; ++n) {
    const T* x = logits + n * in.row_stride;
    T* g = grad + n * grad_row_stride;
    const int64_t local = in.target[n] - in.vocab_start;
    const bool mine = local >= 0 && local < in.vocab;
    const float x_target = mine ? load_f(x, local) : 0.0f;
    if constexpr (sizeof(T) == 4) row_grad_f32(x, in.vocab, scale, log_z[n], entropy[n], g_lp[n], g_ent[n], g);
    else row_grad_bf16(x, in.vocab, scale, log_z[n], entropy[n], g_lp[n], g_ent[n], g);
    if (mine) set_target_grad(x_target, local, scale, log_z[n], entropy[n], g_lp[n], g_ent[n], g);
  }
}

void backward_f64(const mppo_logits& in, const double* log_z, const double* entropy, const double* g_lp,
                  const double* g_ent, double* grad, int64_t grad_row_stride) {
  const double* logits = static_cast<const double*>(in.data);
  const double scale = in.inv_temperature;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t n = 0; n < in.n_rows; ++n) {
    const double* x = logits + n * in.row_stride;
    double* g = grad + n * grad_row_stride;
    const int64_t local = in.target[n] - in.vocab_start;
    for (int64_t j = 0; j < in.vocab; ++j) {  // element-wise: safe when grad aliases the logits
      const double xj = x[j] * scale;
      const double p = std::exp(xj - log_z[n]);
      const double term = p == 0.0 ? 0.0 : -p * (g_lp[n] + g_ent[n] * (xj - log_z[n] + entropy[n]));
      g[j] = scale * (term + (j == local ? g_lp[n] : 0.0));
    }
  }
}

}  // namespace

void lse_partials(const mppo_logits& logits, void* out) {
  switch (logits.dtype) {
    case MPPO_F32: return partials_low_precision<float>(logits, static_cast<float*>(out));
    case MPPO_BF16: return partials_low_precision<uint16_t>(logits, static_cast<float*>(out));
    case MPPO_F64: return partials_f64(logits, static_cast<double*>(out));
    default: return;
  }
}

void lse_backward(const mppo_logits& logits, const void* log_z, const void* entropy, const void* grad_logp,
                  const void* grad_entropy, void* grad, int64_t grad_row_stride) {
  switch (logits.dtype) {
    case MPPO_F32:
      return backward_low_precision(logits, static_cast<const float*>(log_z), static_cast<const float*>(entropy),
                                    static_cast<const float*>(grad_logp), static_cast<const float*>(grad_entropy),
                                    static_cast<float*>(grad), grad_row_stride);
    case MPPO_BF16:
      return backward_low_precision(logits, static_cast<const float*>(log_z), static_cast<const float*>(entropy),
                                    static_cast<const float*>(grad_logp), static_cast<const float*>(grad_entropy),
                                    static_cast<uint16_t*>(grad), grad_row_stride);
    case MPPO_F64:
      return backward_f64(logits, static_cast<const double*>(log_z), static_cast<const double*>(entropy),
                          static_cast<const double*>(grad_logp), static_cast<const double*>(grad_entropy),
                          static_cast<double*>(grad), grad_row_stride);
    default: return;
  }
}

}  // namespace mppo_cpu
