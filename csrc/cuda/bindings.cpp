// torch bindings of the CUDA kernels (module megatron_ppo._kernels_cuda); built only where torch has CUDA.
// Checks tensors, allocates outputs/workspace through torch's caching allocator, launches on the current stream.
// Only c10/cuda headers (no ATen/cuda/CUDAContext.h, which pulls cuBLAS/cuSPARSE/cuSOLVER headers): the file then
// also passes a syntax-only compile against a CPU torch plus the bare CUDA toolkit (tests/unit/test_ops_build.py).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "../common/torch_bindings.h"
#include "kernels.h"

namespace {

using mppo_bind::float_code;

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device(), ", got ", t.device());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "megatron_ppo CUDA kernel ", what, " failed: ", cudaGetErrorString(err));
}

std::vector<at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                            double gamma, double lam, at::ScalarType out_dtype, int64_t algo) {
  TORCH_CHECK(rewards.is_cuda(), "token_level_rewards must be a CUDA tensor");
  check_cuda(values, rewards, "values");
  check_cuda(mask, rewards, "response_mask");
  mppo_bind::check_gae_shapes(rewards, values, mask);
  TORCH_CHECK(algo >= 0 && algo <= 2, "algo must be 0 (auto), 1 (serial) or 2 (scan)");
  const c10::cuda::CUDAGuard guard(rewards.device());
  auto r = rewards.contiguous();
  auto v = values.contiguous();
  auto m = mask.contiguous();
  auto opts = rewards.options().dtype(out_dtype);
  auto adv = at::empty(rewards.sizes(), opts);
  auto ret = at::empty(rewards.sizes(), opts);
  auto counts = at::zeros({3}, rewards.options().dtype(at::kLong));
  check_launch(mppo_cuda_gae(r.data_ptr(), float_code(r, "token_level_rewards"), v.data_ptr(), float_code(v, "values"),
                             mppo_bind::mask_view(m, "response_mask"), adv.data_ptr(), ret.data_ptr(),
                             float_code(adv, "output dtype"), r.size(0), r.size(1), gamma, lam,
                             static_cast<mppo_gae_algo>(algo), counts.data_ptr<int64_t>(),
                             c10::cuda::getCurrentCUDAStream()),
               "gae");
  return {adv, ret, counts};
}

// Checks the devices first: c10::cuda::CUDAGuard on a CPU device is an internal assert, not a message.
mppo_logits describe(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                     double inv_temperature) {
  TORCH_CHECK(logits.is_cuda(), "logits must be a CUDA tensor, got ", logits.device());
  check_cuda(target, logits, "target_ids");
  return mppo_bind::describe(logits, target, vocab_start, inv_temperature);
}

int sm_count() {
  int device = 0, count = 0;
  check_launch(cudaGetDevice(&device), "cudaGetDevice");
  check_launch(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return count;
}

at::Tensor lse_partials(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                        double inv_temperature) {
  const mppo_logits in = describe(logits, target, vocab_start, inv_temperature);  // device checks before the guard
  const c10::cuda::CUDAGuard guard(logits.device());
  const int sm = sm_count();
  auto out = at::empty({4, logits.size(0)}, logits.options().dtype(mppo_bind::stats_dtype(in.dtype)));
  const size_t ws_bytes = mppo_cuda_lse_workspace_bytes(in.n_rows, in.vocab, in.dtype, sm);
  auto ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
  check_launch(mppo_cuda_lse_partials(in, out.data_ptr(), ws_bytes ? ws.data_ptr() : nullptr, ws_bytes, sm,
                                      c10::cuda::getCurrentCUDAStream()),
               "lse_partials");
  return out;
}

at::Tensor lse_backward(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                        double inv_temperature, const at::Tensor& log_z, const at::Tensor& entropy,
                        const at::Tensor& grad_logp, const at::Tensor& grad_entropy,
                        const c10::optional<at::Tensor>& out) {
  const mppo_logits in = describe(logits, target, vocab_start, inv_temperature);  // device checks before the guard
  for (const auto* t : {&log_z, &entropy, &grad_logp, &grad_entropy}) check_cuda(*t, logits, "row statistics");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto rows = mppo_bind::row_statistics(in, {&log_z, &entropy, &grad_logp, &grad_entropy});
  at::Tensor grad = mppo_bind::grad_buffer(logits, out);
  check_launch(mppo_cuda_lse_backward(in, rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(),
                                      rows[3].data_ptr(), grad.data_ptr(), grad.stride(0), sm_count(),
                                      c10::cuda::getCurrentCUDAStream()),
               "lse_backward");
  return grad;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ppo CUDA kernels: GAE and fused log-prob/entropy";
  m.def("gae", &gae,
        "(advantages, returns, [NaN/inf rewards, NaN/inf values at valid positions, mask entries not 0/1]); "
        "algo 0 auto, 1 serial, 2 scan");
  m.def("lse_partials", &lse_partials, "per-row [4, N] (max, sum-exp, sum exp*shifted logit, target logit)",
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("vocab_start"),
        pybind11::arg("inv_temperature"));
  m.def("lse_backward", &lse_backward, "grad wrt logits of g_lp*logp + g_ent*entropy (into out when given)",
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("vocab_start"),
        pybind11::arg("inv_temperature"), pybind11::arg("log_z"), pybind11::arg("entropy"),
        pybind11::arg("grad_logp"), pybind11::arg("grad_entropy"), pybind11::arg("out") = pybind11::none());
}
