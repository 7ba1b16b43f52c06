// GAE on the CPU: one row per OpenMP iteration, reverse recursion over T in double precision.
#include <cmath>

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
// positions cannot leak in), then outputs zeroed at masked positions. One row per iteration: at ~17 bytes per
// step the loop is bound by memory traffic, not by the FMA latency chain (interleaving rows measured no faster).
// The mask is read as raw bits of its own dtype (Bits = its element size): validity and the 0/1 check are two
// integer compares in the same pass, so float/int masks cost what bool masks do (no conversion pass before).
template <typename Bits, typename R, typename V, typename O>
void gae_rows(const R* rewards, const V* values, const mppo_mask mask, O* adv, O* ret, int64_t batch,
              int64_t length, double gamma, double lam, int64_t* counts) {
  const double gamma_lam = gamma * lam;
  int64_t bad_rewards = 0, bad_values = 0, bad_mask = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad_rewards, bad_values, bad_mask)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t row = b * length;
    double next_value = 0.0, last_gae = 0.0;
    for (int64_t t = length - 1; t >= 0; --t) {  // branch-free: masks are often ragged
      const int64_t i = row + t;
      const uint64_t bits = mppo_mask_bits<Bits>(mask, i);
      const bool valid = mppo_mask_valid(mask, bits);
      bad_mask += mppo_mask_not01(mask, bits);
      const double r = load(rewards, i), v = load(values, i);
      bad_rewards += valid && !std::isfinite(r);
      bad_values += valid && !std::isfinite(v);
      const double stepped = r + gamma * next_value - v + gamma_lam * last_gae;
      last_gae = valid ? stepped : last_gae;
      next_value = valid ? v : next_value;
      store(adv, i, valid ? last_gae : 0.0);
      store(ret, i, valid ? last_gae + v : 0.0);
    }
  }
  counts[0] = bad_rewards;
  counts[1] = bad_values;
  counts[2] = bad_mask;
}

template <typename Bits, typename R, typename V>
void dispatch_out(const R* r, const V* v, const mppo_mask& m, void* adv, void* ret, mppo_dtype out, int64_t b,
                  int64_t t, double g, double l, int64_t* c) {
  switch (out) {
    case MPPO_F32:
      return gae_rows<Bits>(r, v, m, static_cast<float*>(adv), static_cast<float*>(ret), b, t, g, l, c);
    case MPPO_F64:
      return gae_rows<Bits>(r, v, m, static_cast<double*>(adv), static_cast<double*>(ret), b, t, g, l, c);
    case MPPO_BF16:
      return gae_rows<Bits>(r, v, m, static_cast<uint16_t*>(adv), static_cast<uint16_t*>(ret), b, t, g, l, c);
    default: return;
  }
}

template <typename Bits, typename R>
void dispatch_values(const R* r, const void* v, mppo_dtype vt, const mppo_mask& m, void* adv, void* ret,
                     mppo_dtype out, int64_t b, int64_t t, double g, double l, int64_t* c) {
  switch (vt) {
    case MPPO_F32: return dispatch_out<Bits>(r, static_cast<const float*>(v), m, adv, ret, out, b, t, g, l, c);
    case MPPO_F64: return dispatch_out<Bits>(r, static_cast<const double*>(v), m, adv, ret, out, b, t, g, l, c);
    case MPPO_BF16: return dispatch_out<Bits>(r, static_cast<const uint16_t*>(v), m, adv, ret, out, b, t, g, l, c);
    default: return;
  }
}

template <typename Bits>
void dispatch_rewards(const void* r, mppo_dtype rt, const void* v, mppo_dtype vt, const mppo_mask& m, void* adv,
                      void* ret, mppo_dtype out, int64_t b, int64_t t, double g, double l, int64_t* c) {
  switch (rt) {
    case MPPO_F32: return dispatch_values<Bits>(static_cast<const float*>(r), v, vt, m, adv, ret, out, b, t, g, l, c);
    case MPPO_F64: return dispatch_values<Bits>(static_cast<const double*>(r), v, vt, m, adv, ret, out, b, t, g, l, c);
    case MPPO_BF16:
      return dispatch_values<Bits>(static_cast<const uint16_t*>(r), v, vt, m, adv, ret, out, b, t, g, l, c);
    default: return;
  }
}

}  // namespace

void gae(const void* rewards, mppo_dtype rt, const void* values, mppo_dtype vt, const mppo_mask& mask, void* adv,
         void* ret, mppo_dtype out, int64_t batch, int64_t length, double gamma, double lam, int64_t* counts) {
  counts[0] = counts[1] = counts[2] = 0;
  const auto& m = mask;
  const int64_t b = batch, t = length;
  switch (mask.bytes) {
    case 1: return dispatch_rewards<uint8_t>(rewards, rt, values, vt, m, adv, ret, out, b, t, gamma, lam, counts);
    case 2: return dispatch_rewards<uint16_t>(rewards, rt, values, vt, m, adv, ret, out, b, t, gamma, lam, counts);
    case 4: return dispatch_rewards<uint32_t>(rewards, rt, values, vt, m, adv, ret, out, b, t, gamma, lam, counts);
    case 8: return dispatch_rewards<uint64_t>(rewards, rt, values, vt, m, adv, ret, out, b, t, gamma, lam, counts);
    default: return;
  }
}

}  // namespace mppo_cpu
