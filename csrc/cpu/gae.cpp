// GAE on the CPU: one row per OpenMP iteration, reverse recursion over T in double precision.
#include <cstring>

#include "kernels.h"

namespace mppo_cpu {
namespace {

inline double load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }
inline double load(const uint16_t* p, int64_t i) { return mppo_bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, double x) { p[i] = static_cast<float>(x); }
inline void store(double* p, int64_t i, double x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, double x) { p[i] = mppo_float_to_bf16(static_cast<float>(x)); }

// verl's recursion with "skip" semantics at masked steps (select, not multiply-by-mask, so NaN/garbage at masked
// positions cannot leak in), then outputs zeroed at masked positions.
template <typename R, typename V, typename O>
void gae_rows(const R* rewards, const V* values, const uint8_t* mask, O* adv, O* ret, int64_t batch, int64_t length,
              double gamma, double lam) {
  const double gamma_lam = gamma * lam;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t row = b * length;
    double next_value = 0.0, last_gae = 0.0;
    for (int64_t t = length - 1; t >= 0; --t) {
      // Branch-free (masks are often ragged): selects, not multiplies, so masked inputs never enter.
      const int64_t i = row + t;
      const bool valid = mask[i] != 0;
      const double v = load(values, i);
      const double stepped = load(rewards, i) + gamma * next_value - v + gamma_lam * last_gae;
      last_gae = valid ? stepped : last_gae;
      next_value = valid ? v : next_value;
      store(adv, i, valid ? last_gae : 0.0);
      store(ret, i, valid ? last_gae + v : 0.0);
    }
  }
}

template <typename R, typename V>
void dispatch_out(const R* r, const V* v, const uint8_t* m, void* adv, void* ret, mppo_dtype out, int64_t b,
                  int64_t t, double g, double l) {
  switch (out) {
    case MPPO_F32: return gae_rows(r, v, m, static_cast<float*>(adv), static_cast<float*>(ret), b, t, g, l);
    case MPPO_F64: return gae_rows(r, v, m, static_cast<double*>(adv), static_cast<double*>(ret), b, t, g, l);
    case MPPO_BF16: return gae_rows(r, v, m, static_cast<uint16_t*>(adv), static_cast<uint16_t*>(ret), b, t, g, l);
    default: return;
  }
}

template <typename R>
void dispatch_values(const R* r, const void* v, mppo_dtype vt, const uint8_t* m, void* adv, void* ret,
                     mppo_dtype out, int64_t b, int64_t t, double g, double l) {
  switch (vt) {
    case MPPO_F32: return dispatch_out(r, static_cast<const float*>(v), m, adv, ret, out, b, t, g, l);
    case MPPO_F64: return dispatch_out(r, static_cast<const double*>(v), m, adv, ret, out, b, t, g, l);
    case MPPO_BF16: return dispatch_out(r, static_cast<const uint16_t*>(v), m, adv, ret, out, b, t, g, l);
    default: return;
  }
}

}  // namespace

void gae(const void* rewards, mppo_dtype rt, const void* values, mppo_dtype vt, const uint8_t* mask, void* adv,
         void* ret, mppo_dtype out, int64_t batch, int64_t length, double gamma, double lam) {
  switch (rt) {
    case MPPO_F32:
      return dispatch_values(static_cast<const float*>(rewards), values, vt, mask, adv, ret, out, batch, length,
                             gamma, lam);
    case MPPO_F64:
      return dispatch_values(static_cast<const double*>(rewards), values, vt, mask, adv, ret, out, batch, length,
                             gamma, lam);
    case MPPO_BF16:
      return dispatch_values(static_cast<const uint16_t*>(rewards), values, vt, mask, adv, ret, out, batch, length,
                             gamma, lam);
    default: return;
  }
}

}  // namespace mppo_cpu
