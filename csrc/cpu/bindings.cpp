// torch bindings of the CPU kernels (module megatron_ppo._kernels_cpu). Only this file sees ATen: it checks
// tensors, allocates outputs and hands raw pointers to the kernels. Python-facing validation with argument names
// lives in megatron_ppo/ops; these checks guard the pointers.
#include <torch/extension.h>

#include "kernels.h"

namespace {

mppo_dtype float_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return MPPO_F32;
    case at::kDouble: return MPPO_F64;
    case at::kBFloat16: return MPPO_BF16;
    default: TORCH_CHECK(false, name, " must be float32, float64 or bfloat16, got ", t.scalar_type());
  }
  return MPPO_F32;
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
}

void check_rows(const at::Tensor& logits, const at::Tensor& target) {
  check_cpu(logits, "logits");
  check_cpu(target, "target_ids");
  TORCH_CHECK(logits.dim() == 2, "logits must be [N, V_local], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) == 0 || logits.stride(1) == 1, "logits must be contiguous in the vocabulary dim");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "target_ids must be [N] with N = ",
              logits.size(0), ", got ", target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous(), "target_ids must be contiguous int64");
}

std::vector<at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                            double gamma, double lam, at::ScalarType out_dtype) {
  check_cpu(rewards, "token_level_rewards");
  check_cpu(values, "values");
  check_cpu(mask, "response_mask");
  TORCH_CHECK(rewards.dim() == 2, "token_level_rewards must be [B, T], got ", rewards.sizes());
  TORCH_CHECK(values.sizes() == rewards.sizes() && mask.sizes() == rewards.sizes(),
              "values and response_mask must have token_level_rewards' shape ", rewards.sizes());
  TORCH_CHECK(mask.scalar_type() == at::kBool, "response_mask must be bool here");
  auto r = rewards.contiguous();
  auto v = values.contiguous();
  auto m = mask.contiguous();
  auto opts = rewards.options().dtype(out_dtype);
  auto adv = at::empty(rewards.sizes(), opts);
  auto ret = at::empty(rewards.sizes(), opts);
  const auto rt = float_code(r, "token_level_rewards");
  const auto vt = float_code(v, "values");
  const auto ot = float_code(adv, "output dtype");
  auto nonfinite = at::zeros({2}, rewards.options().dtype(at::kLong));
  {
    pybind11::gil_scoped_release no_gil;
    mppo_cpu::gae(r.data_ptr(), rt, v.data_ptr(), vt, reinterpret_cast<const uint8_t*>(m.data_ptr<bool>()),
                  adv.data_ptr(), ret.data_ptr(), ot, r.size(0), r.size(1), gamma, lam,
                  nonfinite.data_ptr<int64_t>());
  }
  return {adv, ret, nonfinite};
}

mppo_logits describe(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                     double inv_temperature) {
  check_rows(logits, target);
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty vocabulary dim");
  TORCH_CHECK(inv_temperature > 0, "inv_temperature must be > 0");
  return {logits.data_ptr(), float_code(logits, "logits"), logits.size(0), logits.size(1), logits.stride(0),
          target.data_ptr<int64_t>(), vocab_start, inv_temperature};
}

at::Tensor lse_partials(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                        double inv_temperature) {
  const mppo_logits in = describe(logits, target, vocab_start, inv_temperature);
  auto out = at::empty({4, logits.size(0)}, logits.options().dtype(in.dtype == MPPO_F64 ? at::kDouble : at::kFloat));
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
  const auto stats_dtype = in.dtype == MPPO_F64 ? at::kDouble : at::kFloat;
  std::vector<at::Tensor> rows;
  for (const auto* t : {&log_z, &entropy, &grad_logp, &grad_entropy}) {
    check_cpu(*t, "row statistics");
    TORCH_CHECK(t->dim() == 1 && t->size(0) == logits.size(0), "row statistics must be [N]");
    rows.push_back(t->to(stats_dtype).contiguous());
  }
  at::Tensor grad;
  if (out.has_value()) {  // e.g. (a view of) the logits themselves: in-place backward
    grad = *out;
    TORCH_CHECK(grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type() &&
                    grad.device() == logits.device() && grad.stride(1) == 1,
                "out must have the logits' shape, dtype and device, contiguous in the vocabulary dim");
  } else {
    grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  }
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
        "(advantages, returns, [NaN/inf rewards, NaN/inf values] at valid positions); un-whitened, 0 where masked");
  m.def("lse_partials", &lse_partials, "per-row [4, N] (max, sum-exp, sum exp*shifted logit, target logit)",
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("vocab_start"),
        pybind11::arg("inv_temperature"));
  m.def("lse_backward", &lse_backward, "grad wrt logits of g_lp*logp + g_ent*entropy (into out when given)",
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("vocab_start"),
        pybind11::arg("inv_temperature"), pybind11::arg("log_z"), pybind11::arg("entropy"),
        pybind11::arg("grad_logp"), pybind11::arg("grad_entropy"), pybind11::arg("out") = pybind11::none());
}
