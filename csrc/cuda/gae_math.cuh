// The per-step math of the GAE kernels (gae.cu), __host__ __device__ (MPPO_HD) so that the host harness of
// tests/unit/test_ops_cuda_host.py runs the very functions the kernels run (compiled with nvcc as host code).
//
// Step t maps the carried state s = (next_value, last_gae) from t+1 to t by an affine map with a lower-triangular
// linear part:   valid:  N = v_t,  A = gamma N' + gamma lam A' + (r_t - v_t)      masked: identity
// Maps compose associatively; the scan kernel composes a thread's ITEMS steps (compose_items), scans the
// compositions over the block, and replays each thread's steps from its right-boundary state (replay_items).
#pragma once
#include <stdint.h>

#include "../types.h"
#include "common.cuh"

namespace mppo_cuda {

// s = F(s') with N = a N' + b1, A = g N' + c A' + b2.
template <typename Acc>
struct Affine {
  Acc a, g, c, b1, b2;
};

template <typename Acc>
MPPO_HD Affine<Acc> identity() {
  return {Acc(1), Acc(0), Acc(1), Acc(0), Acc(0)};
}

// f o h (apply h first).
template <typename Acc>
MPPO_HD Affine<Acc> compose(const Affine<Acc>& f, const Affine<Acc>& h) {
  return {f.a * h.a, f.g * h.a + f.c * h.g, f.c * h.c, f.a * h.b1 + f.b1, f.g * h.b1 + f.c * h.b2 + f.b2};
}

// The map of a valid step.
template <typename Acc>
MPPO_HD Affine<Acc> step_map(Acc r, Acc v, Acc gamma, Acc gamma_lam) {
  return {Acc(0), gamma, gamma_lam, v, r - v};
}

// (next_value, last_gae) <- f(next_value, last_gae).
template <typename Acc>
MPPO_HD void apply(const Affine<Acc>& f, Acc& next_value, Acc& last_gae) {
  const Acc n = f.a * next_value + f.b1;
  last_gae = f.g * next_value + f.c * last_gae + f.b2;
  next_value = n;
}

// verl's recursion at a valid step (the serial kernel, and the scan's replay).
template <typename Acc>
MPPO_HD void gae_step(Acc& next_value, Acc& last_gae, Acc r, Acc v, Acc gamma, Acc gamma_lam) {
  last_gae = r + gamma * next_value - v + gamma_lam * last_gae;
  next_value = v;
}

// The composition of steps [first, first + ITEMS) of a tile (valid where m != 0), the last step applied first.
template <int ITEMS, typename Acc>
MPPO_HD Affine<Acc> compose_items(const uint8_t* m, const Acc* r, const Acc* v, int first, Acc gamma,
                                  Acc gamma_lam) {
  Affine<Acc> mine = identity<Acc>();
  MPPO_UNROLL
  for (int j = ITEMS - 1; j >= 0; --j)
    if (m[first + j]) mine = compose(step_map(r[first + j], v[first + j], gamma, gamma_lam), mine);
  return mine;
}

// Replays steps [first, first + ITEMS) from the state at their right boundary with the plain recursion, writing
// advantages over r and returns over v (0 at masked steps).
template <int ITEMS, typename Acc>
MPPO_HD void replay_items(const uint8_t* m, Acc* r, Acc* v, int first, Acc next_value, Acc last_gae, Acc gamma,
                          Acc gamma_lam) {
  MPPO_UNROLL
  for (int j = ITEMS - 1; j >= 0; --j) {
    const int i = first + j;
    if (m[i]) {
      const Acc value = v[i];
      gae_step(next_value, last_gae, r[i], value, gamma, gamma_lam);
      r[i] = last_gae;
      v[i] = last_gae + value;
    } else {
      r[i] = Acc(0);
      v[i] = Acc(0);
    }
  }
}

}  // namespace mppo_cuda
