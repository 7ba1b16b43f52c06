// torch bindings of the CPU kernels (module megatron_ppo._kernels_cpu). Only this file sees ATen: it checks
// tensors, allocates outputs and hands raw pointers to the kernels. Python-facing validation with argument names
// lives in megatron_ppo/ops; these checks guard the pointers.
#include <torch/extension.h>

#include "../common/torch_bindings.h"
#include "kernels.h"

namespace {

using mppo_bind::float_code;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
}

std::vector<at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                            double gamma, double lam, at::ScalarType out_dtype) {
  check_cpu(rewards, "token_level_rewards");
  check_cpu(values, "values");
  check_cpu(mask, "response_mask");
  mppo_bind::check_gae_shapes(rewards, values, mask);
  auto r = rewards.contiguous();
  auto v = values.contiguous();
  auto m = mask.contiguous();
  auto opts = rewards.options().dtype(out_dtype);
  auto adv = at::empty(rewards.sizes(), opts);
  auto ret = at::empty(rewards.sizes(), opts);
  const auto rt = float_code(r, "token_level_rewards");
  const auto vt = float_code(v, "values");
  const auto ot = float_code(adv, "output dtype");
  const mppo_mask mv = mppo_bind::mask_view(m, "response_mask");
  auto counts = at::zeros({3}, rewards.options().dtype(at::kLong));
  {
    pybind11::gil_scoped_release no_gil;
    mppo_cpu::gae(r.data_ptr(), rt, v.data_ptr(), vt, mv, adv.data_ptr(), ret.data_ptr(), ot, r.size(0), r.size(1),
                  gamma, lam, counts.data_ptr<int64_t>());
  }
  return {adv, ret, counts};
}

mppo_logits describe(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                     double inv_temperature) {
  check_cpu(logits, "logits");
  check_cpu(target, "target_ids");
  return mppo_bind::describe(logits, target, vocab_start, inv_temperature);
}

at::Tensor lse_partials(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                        double inv_temperature) {
  const mppo_logits in = describe(logits, target, vocab_start, inv_temperature);
  auto out = at::empty({4, logits.size(0)}, logits.options().dtype(mppo_bind::stats_dtype(in.dtype)));
  {
    pybind11::gil_scoped_release no_gil;
    mppo_cpu::lse_partials(in, out.data_ptr());
  }
  return out;
}

at::Tensor lse_backward(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                        double inv_temperature, const at::Tensor& log_z, const at::Tensor& entropy,
                        const at::Tensor& grad_logp, const at::Tensor& grad_entropy,
                        const c10::optional<at::Tensor>& out) {
  const mppo_logits in = describe(logits, target, vocab_start, inv_temperature);
  for (const auto* t : {&log_z, &entropy, &grad_logp, &grad_entropy}) check_cpu(*t, "row statistics");
  const auto rows = mppo_bind::row_statistics(in, {&log_z, &entropy, &grad_logp, &grad_entropy});
  at::Tensor grad = mppo_bind::grad_buffer(logits, out);
  {
    pybind11::gil_scoped_release no_gil;
    mppo_cpu::lse_backward(in, rows[0].data_ptr(), rows[1].data_ptr(), rows[2].data_ptr(), rows[3].data_ptr(),
                           grad.data_ptr(), grad.stride(0));
  }
  return grad;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ppo CPU kernels: GAE and fused log-prob/entropy (OpenMP)";
  m.def("gae", &gae,
        "(advantages, returns, [NaN/inf rewards, NaN/inf values at valid positions, mask entries not 0/1]); "
        "un-whitened, 0 where masked; the mask may be bool, integer or floating");
  m.def("lse_partials", &lse_partials, "per-row [4, N] (max, sum-exp, sum exp*shifted logit, target logit)",
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("vocab_start"),
        pybind11::arg("inv_temperature"));
  m.def("lse_backward", &lse_backward, "grad wrt logits of g_lp*logp + g_ent*entropy (into out when given)",
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("vocab_start"),
        pybind11::arg("inv_temperature"), pybind11::arg("log_z"), pybind11::arg("entropy"),
        pybind11::arg("grad_logp"), pybind11::arg("grad_entropy"), pybind11::arg("out") = pybind11::none());
}
