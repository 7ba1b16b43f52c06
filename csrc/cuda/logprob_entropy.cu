// Fused log-prob + entropy statistics and gradient on the GPU. One pass over the logits: every thread keeps an
// online (max, sum exp, sum exp * shifted logit) triple, blocks merge triples with warp shuffles, and rows are split
// over several blocks only when there are too few rows to fill the GPU (a second tiny kernel merges the splits).
// Loads and stores are 16-byte vectors when the row is 16-byte aligned.
#include "common.cuh"
#include "kernels.h"
#include "lse_math.cuh"  // online_add / merge / accumulate_columns / chunk_for: shared with the host test harness

namespace mppo_cuda {
namespace {

template <typename Acc>
__device__ __forceinline__ Triple<Acc> block_merge(Triple<Acc> t) {
  __shared__ Triple<Acc> s_warp[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Triple<Acc> o{__shfl_down_sync(0xffffffffu, t.m, offset), __shfl_down_sync(0xffffffffu, t.s, offset),
                  __shfl_down_sync(0xffffffffu, t.w, offset)};
    t = merge(t, o);
  }
  if (lane == 0) s_warp[warp] = t;
  __syncthreads();
  if (warp == 0) {
    t = lane < kThreads / 32 ? s_warp[lane] : empty_triple<Acc>();
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      Triple<Acc> o{__shfl_down_sync(0xffffffffu, t.m, offset), __shfl_down_sync(0xffffffffu, t.s, offset),
                    __shfl_down_sync(0xffffffffu, t.w, offset)};
      t = merge(t, o);
    }
  }
  return t;  // valid in thread 0
}

// Rows split into gridDim.y chunks of `chunk` elements (a multiple of kThreads * 16-byte vector).
// splits == 1: writes out[4, N] directly; else partial[row][split] = (m, s, w), merged by merge_splits_kernel.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads) lse_partials_kernel(mppo_logits in, int64_t chunk, Acc* __restrict__ out,
                                                               Acc* __restrict__ partial) {
  const int64_t row = blockIdx.x, n_rows = in.n_rows, vocab = in.vocab;
  const int64_t start = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t stop = start + chunk < vocab ? start + chunk : vocab;
  const T* x = static_cast<const T*>(in.data) + row * in.row_stride;
  const Acc scale = static_cast<Acc>(in.inv_temperature);
  Triple<Acc> t = empty_triple<Acc>();
  accumulate_columns<kThreads>(t, x, start, stop, threadIdx.x, scale);
  t = block_merge(t);
  if (threadIdx.x != 0) return;
  if (gridDim.y == 1) {
    const int64_t local = in.target[row] - in.vocab_start;
    out[row] = t.m;
    out[n_rows + row] = t.s;
    out[2 * n_rows + row] = t.w;
    out[3 * n_rows + row] = (local >= 0 && local < vocab) ? elem<Acc>(x[local]) * scale : Acc(0);
  } else {
    Acc* p = partial + (row * gridDim.y + blockIdx.y) * 3;
    p[0] = t.m;
    p[1] = t.s;
    p[2] = t.w;
  }
}

template <typename T, typename Acc>
__global__ void merge_splits_kernel(mppo_logits in, int splits, const Acc* __restrict__ partial,
                                    Acc* __restrict__ out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_rows = in.n_rows;
  if (row >= n_rows) return;
  Triple<Acc> t = empty_triple<Acc>();
  for (int k = 0; k < splits; ++k) {
    const Acc* p = partial + (row * splits + k) * 3;
    t = merge(t, Triple<Acc>{p[0], p[1], p[2]});
  }
  const int64_t local = in.target[row] - in.vocab_start;
  const T* x = static_cast<const T*>(in.data) + row * in.row_stride;
  out[row] = t.m;
  out[n_rows + row] = t.s;
  out[2 * n_rows + row] = t.w;
  out[3 * n_rows + row] =
      (local >= 0 && local < in.vocab) ? elem<Acc>(x[local]) * static_cast<Acc>(in.inv_temperature) : Acc(0);
}

// d/dlogit_j with x = scale * logit: scale * (-p_j (g_lp + g_ent (x_j - log_z + H)) + g_lp [j == target])
template <typename Acc>
__device__ __forceinline__ Acc grad_elem(Acc logit, Acc scale, Acc log_z, Acc shift, Acc g_lp, Acc g_ent,
                                         bool is_target) {
  const Acc x = logit * scale;
  const Acc p = fast_exp(x - log_z);
  const Acc g = p == Acc(0) ? Acc(0) : -p * (g_lp + g_ent * (x + shift));
  return scale * (is_target ? g + g_lp : g);
}

template <typename T>
__device__ __forceinline__ T to_elem(float x);
template <> __device__ __forceinline__ float to_elem<float>(float x) { return x; }
template <> __device__ __forceinline__ uint16_t to_elem<uint16_t>(float x) { return mppo_float_to_bf16(x); }
template <typename T>
__device__ __forceinline__ T to_elem(double x);
template <> __device__ __forceinline__ double to_elem<double>(double x) { return x; }

// logits and grad may alias (in-place backward): each element is read and then written by the same thread, so
// neither pointer is __restrict__ and loads avoid the read-only (non-coherent) path.
template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads) lse_backward_kernel(mppo_logits in, int64_t chunk,
                                                               const Acc* __restrict__ log_z,
                                                               const Acc* __restrict__ entropy,
                                                               const Acc* __restrict__ grad_logp,
                                                               const Acc* __restrict__ grad_entropy, T* grad,
                                                               int64_t grad_row_stride) {
  constexpr int VEC = Vec16<T>::N;
  const int64_t row = blockIdx.x, vocab = in.vocab;
  const int64_t start = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t stop = start + chunk < vocab ? start + chunk : vocab;
  const T* x = static_cast<const T*>(in.data) + row * in.row_stride;
  T* g = grad + row * grad_row_stride;
  const Acc scale = static_cast<Acc>(in.inv_temperature);
  const Acc lz = log_z[row], shift = entropy[row] - log_z[row], glp = grad_logp[row], gent = grad_entropy[row];
  const int64_t local = in.target[row] - in.vocab_start;
  int64_t scalar_from = start;
  if (((reinterpret_cast<uintptr_t>(x + start) | reinterpret_cast<uintptr_t>(g + start)) & 15) == 0) {
    const int64_t n_vec = (stop - start) / VEC;
    const uint4* xv = reinterpret_cast<const uint4*>(x + start);
    uint4* gv = reinterpret_cast<uint4*>(g + start);
    for (int64_t k = threadIdx.x; k < n_vec; k += kThreads) {
      Pack16<T> vin, vout;
      vin.raw = xv[k];
      const int64_t j0 = start + k * VEC;
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        vout.e[e] = to_elem<T>(grad_elem<Acc>(elem<Acc>(vin.e[e]), scale, lz, shift, glp, gent, j0 + e == local));
      gv[k] = vout.raw;
    }
    scalar_from = start + n_vec * VEC;
  }
  for (int64_t j = scalar_from + threadIdx.x; j < stop; j += kThreads)
    g[j] = to_elem<T>(grad_elem<Acc>(elem<Acc>(x[j]), scale, lz, shift, glp, gent, j == local));
}

template <typename T, typename Acc>
cudaError_t launch_partials(const mppo_logits& in, Acc* out, void* workspace, size_t workspace_bytes, int sm_count,
                            cudaStream_t stream) {
  const int64_t chunk = chunk_for(in.n_rows, in.vocab, sm_count);
  const unsigned int splits = static_cast<unsigned int>(splits_for(in.vocab, chunk));
  if (splits > 1 && workspace_bytes < static_cast<size_t>(in.n_rows) * splits * 3 * sizeof(Acc))
    return cudaErrorInvalidValue;
  Acc* partial = static_cast<Acc*>(workspace);
  const dim3 grid(static_cast<unsigned int>(in.n_rows), splits);
  lse_partials_kernel<T, Acc><<<grid, kThreads, 0, stream>>>(in, chunk, out, partial);
  if (splits > 1)
    merge_splits_kernel<T, Acc><<<ceil_div(in.n_rows, 128), 128, 0, stream>>>(in, static_cast<int>(splits), partial,
                                                                            out);
  return cudaGetLastError();
}

template <typename T, typename Acc>
cudaError_t launch_backward(const mppo_logits& in, const void* log_z, const void* entropy, const void* g_lp,
                            const void* g_ent, void* grad, int64_t grad_row_stride, int sm_count,
                            cudaStream_t stream) {
  const int64_t chunk = chunk_for(in.n_rows, in.vocab, sm_count);
  const dim3 grid(static_cast<unsigned int>(in.n_rows), ceil_div(in.vocab, chunk));
  lse_backward_kernel<T, Acc><<<grid, kThreads, 0, stream>>>(
      in, chunk, static_cast<const Acc*>(log_z), static_cast<const Acc*>(entropy), static_cast<const Acc*>(g_lp),
      static_cast<const Acc*>(g_ent), static_cast<T*>(grad), grad_row_stride);
  return cudaGetLastError();
}

}  // namespace
}  // namespace mppo_cuda

extern "C" size_t mppo_cuda_lse_workspace_bytes(int64_t n_rows, int64_t vocab, mppo_dtype dtype, int sm_count) {
  if (n_rows <= 0 || vocab <= 0) return 0;  // nothing to launch (and no division by n_rows = 0)
  const int64_t chunk = mppo_cuda::chunk_for(n_rows, vocab, sm_count);
  const int64_t splits = mppo_cuda::splits_for(vocab, chunk);
  if (splits <= 1) return 0;
  const size_t acc = dtype == MPPO_F64 ? sizeof(double) : sizeof(float);
  return static_cast<size_t>(n_rows) * splits * 3 * acc;
}

extern "C" cudaError_t mppo_cuda_lse_partials(mppo_logits in, void* out, void* workspace, size_t workspace_bytes,
                                              int sm_count, cudaStream_t stream) {
  using namespace mppo_cuda;
  if (!lse_args_valid(in)) return cudaErrorInvalidValue;
  if (in.n_rows == 0) return cudaSuccess;
  switch (in.dtype) {
    case MPPO_F32:
      return launch_partials<float>(in, static_cast<float*>(out), workspace, workspace_bytes, sm_count, stream);
    case MPPO_BF16:
      return launch_partials<uint16_t>(in, static_cast<float*>(out), workspace, workspace_bytes, sm_count, stream);
    case MPPO_F64:
      return launch_partials<double>(in, static_cast<double*>(out), workspace, workspace_bytes, sm_count, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t mppo_cuda_lse_backward(mppo_logits in, const void* log_z, const void* entropy,
                                              const void* grad_logp, const void* grad_entropy, void* grad,
                                              int64_t grad_row_stride, int sm_count, cudaStream_t stream) {
  using namespace mppo_cuda;
  if (!lse_args_valid(in) || !lse_grad_rows_valid(in, grad_row_stride)) return cudaErrorInvalidValue;
  if (in.n_rows == 0) return cudaSuccess;
  switch (in.dtype) {
    case MPPO_F32:
      return launch_backward<float, float>(in, log_z, entropy, grad_logp, grad_entropy, grad, grad_row_stride,
                                           sm_count, stream);
    case MPPO_BF16:
      return launch_backward<uint16_t, float>(in, log_z, entropy, grad_logp, grad_entropy, grad, grad_row_stride,
                                              sm_count, stream);
    case MPPO_F64:
      return launch_backward<double, double>(in, log_z, entropy, grad_logp, grad_entropy, grad, grad_row_stride,
                                             sm_count, stream);
    default: return cudaErrorInvalidValue;
  }
}
