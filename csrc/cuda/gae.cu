// GAE on the GPU, two algorithms (see kernels.h and docs/kernels.md):
//   serial: one thread per sequence, the literal reverse recursion;
//   scan:   one block per sequence. Step t maps the carried state s = (next_value, last_gae) from t+1 to t by an
//           affine map with a lower-triangular linear part:
//             valid:  N = v_t,  A = gamma N' + gamma lam A' + (r_t - v_t)     masked: identity
//           Maps compose associatively, so each thread composes its ITEMS contiguous steps, a warp-shuffle suffix
//           scan plus a serial pass over the warp totals gives every thread its right-boundary state, and the
//           thread then replays its steps serially (bitwise the same recursion as serial inside a thread).
//           Tiles of THREADS*ITEMS steps are walked from the end of the row, carrying the state.
#include "common.cuh"
#include "gae_math.cuh"  // Affine / compose / gae_step / compose_items / replay_items: shared with the host harness
#include "kernels.h"

namespace mppo_cuda {
namespace {

template <typename Acc>
__device__ __forceinline__ Affine<Acc> shfl_down(const Affine<Acc>& x, int offset) {
  return {__shfl_down_sync(0xffffffffu, x.a, offset), __shfl_down_sync(0xffffffffu, x.g, offset),
          __shfl_down_sync(0xffffffffu, x.c, offset), __shfl_down_sync(0xffffffffu, x.b1, offset),
          __shfl_down_sync(0xffffffffu, x.b2, offset)};
}

// counts[0..2] += NaN/inf rewards, NaN/inf values (at valid positions), mask entries that are not 0/1.
__device__ __forceinline__ void add_counts(int64_t* counts, unsigned int bad_rewards, unsigned int bad_values,
                                           unsigned int bad_mask) {
  if (bad_rewards) atomicAdd(reinterpret_cast<unsigned long long*>(counts), bad_rewards);
  if (bad_values) atomicAdd(reinterpret_cast<unsigned long long*>(counts + 1), bad_values);
  if (bad_mask) atomicAdd(reinterpret_cast<unsigned long long*>(counts + 2), bad_mask);
}

// Raw bits of mask element i (types.h: mppo_mask). The element size is the same for every thread of a launch, so
// the switch never diverges; it keeps one kernel per value dtype instead of one per value and mask dtype.
__device__ __forceinline__ uint64_t mask_bits(const mppo_mask& m, int64_t i) {
  switch (m.bytes) {
    case 1: return mppo_mask_bits<uint8_t>(m, i);
    case 2: return mppo_mask_bits<uint16_t>(m, i);
    case 4: return mppo_mask_bits<uint32_t>(m, i);
    default: return mppo_mask_bits<uint64_t>(m, i);
  }
}

template <typename Acc, typename R, typename V, typename O>
__global__ void gae_serial_kernel(const R* __restrict__ rewards, const V* __restrict__ values, const mppo_mask mask,
                                  O* __restrict__ adv, O* __restrict__ ret, int64_t batch, int64_t length, Acc gamma,
                                  Acc gamma_lam, int64_t* counts) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int64_t row = b * length;
  Acc next_value = 0, last_gae = 0;
  unsigned int bad_rewards = 0, bad_values = 0, bad_mask = 0;
  for (int64_t t = length - 1; t >= 0; --t) {
    const int64_t i = row + t;
    const uint64_t bits = mask_bits(mask, i);
    bad_mask += mppo_mask_not01(mask, bits);
    if (mppo_mask_valid(mask, bits)) {
      const Acc r = load<Acc>(rewards, i), v = load<Acc>(values, i);
      bad_rewards += !isfinite(r);
      bad_values += !isfinite(v);
      gae_step(next_value, last_gae, r, v, gamma, gamma_lam);
      store(adv, i, last_gae);
      store(ret, i, last_gae + v);
    } else {
      store(adv, i, Acc(0));
      store(ret, i, Acc(0));
    }
  }
  add_counts(counts, bad_rewards, bad_values, bad_mask);
}

template <typename Acc, int THREADS, int ITEMS, typename R, typename V, typename O>
__global__ void __launch_bounds__(THREADS) gae_scan_kernel(const R* __restrict__ rewards,
                                                           const V* __restrict__ values, const mppo_mask mask,
                                                           O* __restrict__ adv, O* __restrict__ ret, int64_t length,
                                                           Acc gamma, Acc gamma_lam, int64_t* counts) {
  constexpr int TILE = THREADS * ITEMS;
  constexpr int WARPS = THREADS / 32;
  __shared__ Acc s_r[TILE];  // rewards in, advantages out
  __shared__ Acc s_v[TILE];  // values in, returns out
  __shared__ uint8_t s_m[TILE];
  __shared__ Affine<Acc> s_warp_total[WARPS];
  __shared__ Acc s_warp_state[WARPS][2];
  __shared__ Acc s_carry[2];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * length;
  if (tid == 0) s_carry[0] = s_carry[1] = Acc(0);
  unsigned int bad_rewards = 0, bad_values = 0, bad_mask = 0;

  for (int64_t tile_end = length; tile_end > 0; tile_end -= TILE) {
    const int64_t tile_start = tile_end > TILE ? tile_end - TILE : 0;
    const int n = static_cast<int>(tile_end - tile_start);
    for (int i = tid; i < TILE; i += THREADS) {  // coalesced; padding = masked steps = identity maps
      const bool inside = i < n;
      const int64_t g = row + tile_start + i;
      const uint64_t bits = inside ? mask_bits(mask, g) : 0;
      s_m[i] = mppo_mask_valid(mask, bits);
      bad_mask += mppo_mask_not01(mask, bits);
      s_r[i] = inside ? load<Acc>(rewards, g) : Acc(0);
      s_v[i] = inside ? load<Acc>(values, g) : Acc(0);
      bad_rewards += s_m[i] && !isfinite(s_r[i]);
      bad_values += s_m[i] && !isfinite(s_v[i]);
    }
    __syncthreads();

    const int first = tid * ITEMS;
    const Affine<Acc> mine = compose_items<ITEMS>(s_m, s_r, s_v, first, gamma, gamma_lam);
    Affine<Acc> suffix = mine;  // inclusive suffix composition within the warp: lane .. 31
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const Affine<Acc> other = shfl_down(suffix, offset);
      if (lane + offset < 32) suffix = compose(suffix, other);
    }
    Affine<Acc> after_me = shfl_down(suffix, 1);
    if (lane == 31) after_me = identity<Acc>();
    if (lane == 0) s_warp_total[warp] = suffix;
    __syncthreads();
    if (tid == 0) {  // WARPS serial steps: the state at each warp's right boundary, and the next tile's carry
      Acc n_state = s_carry[0], a_state = s_carry[1];
      for (int w = WARPS - 1; w >= 0; --w) {
        s_warp_state[w][0] = n_state;
        s_warp_state[w][1] = a_state;
        apply(s_warp_total[w], n_state, a_state);
      }
      s_carry[0] = n_state;
      s_carry[1] = a_state;
    }
    __syncthreads();
    Acc next_value = s_warp_state[warp][0], last_gae = s_warp_state[warp][1];
    apply(after_me, next_value, last_gae);  // the state at this thread's right boundary
    replay_items<ITEMS>(s_m, s_r, s_v, first, next_value, last_gae, gamma, gamma_lam);
    __syncthreads();
    for (int i = tid; i < n; i += THREADS) {
      const int64_t g = row + tile_start + i;
      store(adv, g, s_r[i]);
      store(ret, g, s_v[i]);
    }
    __syncthreads();  // smem is reused by the next tile
  }
  add_counts(counts, bad_rewards, bad_values, bad_mask);
}

constexpr int kScanThreads = 256;
constexpr int kScanItems = 4;
constexpr int kSerialThreads = 128;

// Launch-wide arguments that every dtype combination passes through unchanged.
struct GaeArgs {
  mppo_mask mask;
  int64_t batch, length;
  double gamma, lam;
  mppo_gae_algo algo;
  int64_t* counts;
  cudaStream_t stream;
};

template <typename Acc, typename R, typename V, typename O>
cudaError_t launch(const R* r, const V* v, O* adv, O* ret, const GaeArgs& a) {
  const Acc g = static_cast<Acc>(a.gamma), gl = static_cast<Acc>(a.gamma * a.lam);
  if (a.algo == MPPO_GAE_SERIAL) {
    gae_serial_kernel<Acc><<<ceil_div(a.batch, kSerialThreads), kSerialThreads, 0, a.stream>>>(
        r, v, a.mask, adv, ret, a.batch, a.length, g, gl, a.counts);
  } else {
    gae_scan_kernel<Acc, kScanThreads, kScanItems><<<static_cast<unsigned int>(a.batch), kScanThreads, 0, a.stream>>>(
        r, v, a.mask, adv, ret, a.length, g, gl, a.counts);
  }
  return cudaGetLastError();
}

template <typename R, typename V>
cudaError_t dispatch_out(const R* r, const V* v, void* adv, void* ret, mppo_dtype out, const GaeArgs& a) {
  switch (out) {
    case MPPO_F32: return launch<float>(r, v, static_cast<float*>(adv), static_cast<float*>(ret), a);
    case MPPO_F64: return launch<double>(r, v, static_cast<double*>(adv), static_cast<double*>(ret), a);
    case MPPO_BF16: return launch<float>(r, v, static_cast<uint16_t*>(adv), static_cast<uint16_t*>(ret), a);
    default: return cudaErrorInvalidValue;
  }
}

template <typename R>
cudaError_t dispatch_values(const R* r, const void* v, mppo_dtype vt, void* adv, void* ret, mppo_dtype out,
                            const GaeArgs& a) {
  switch (vt) {
    case MPPO_F32: return dispatch_out(r, static_cast<const float*>(v), adv, ret, out, a);
    case MPPO_F64: return dispatch_out(r, static_cast<const double*>(v), adv, ret, out, a);
    case MPPO_BF16: return dispatch_out(r, static_cast<const uint16_t*>(v), adv, ret, out, a);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace mppo_cuda

extern "C" cudaError_t mppo_cuda_gae(const void* rewards, mppo_dtype rt, const void* values, mppo_dtype vt,
                                     mppo_mask mask, void* adv, void* ret, mppo_dtype out, int64_t batch,
                                     int64_t length, double gamma, double lam, mppo_gae_algo algo,
                                     int64_t* counts, cudaStream_t stream) {
  using namespace mppo_cuda;
  if (batch == 0 || length == 0) return cudaSuccess;
  if (batch > 0x7fffffff) return cudaErrorInvalidValue;
  if (mask.bytes != 1 && mask.bytes != 2 && mask.bytes != 4 && mask.bytes != 8) return cudaErrorInvalidValue;
  if (algo == MPPO_GAE_AUTO) algo = MPPO_GAE_SCAN;  // the choice and its measurement: docs/kernels.md
  const GaeArgs a{mask, batch, length, gamma, lam, algo, counts, stream};
  switch (rt) {
    case MPPO_F32: return dispatch_values(static_cast<const float*>(rewards), values, vt, adv, ret, out, a);
    case MPPO_F64: return dispatch_values(static_cast<const double*>(rewards), values, vt, adv, ret, out, a);
    case MPPO_BF16: return dispatch_values(static_cast<const uint16_t*>(rewards), values, vt, adv, ret, out, a);
    default: return cudaErrorInvalidValue;
  }
}
