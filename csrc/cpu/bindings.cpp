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
  {
    pybind11::gil_scoped_release no_gil;
    mppo_cpu::gae(r.data_ptr(), rt, v.data_ptr(), vt, reinterpret_cast<const uint8_t*>(m.data_ptr<bool>()),
                  adv.data_ptr(), ret.data_ptr(), ot, r.size(0), r.size(1), gamma, lam);
  }
  return {adv, ret};
}

at::Tensor lse_partials(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start) {
  check_rows(logits, target);
  const auto dt = float_code(logits, "logits");
  auto stats_dtype = dt == MPPO_F64 ? at::kDouble : at::kFloat;
  auto out = at::empty({4, logits.size(0)}, logits.options().dtype(stats_dtype));
  {
    pybind11::gil_scoped_release no_gil;
    mppo_cpu::lse_partials(logits.data_ptr(), dt, logits.size(0), logits.size(1), logits.stride(0),
                           target.data_ptr<int64_t>(), vocab_start, out.data_ptr());
  }
  return out;
}

at::Tensor lse_backward(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                        const at::Tensor& log_z, const at::Tensor& entropy, const at::Tensor& grad_logp,
                        const at::Tensor& grad_entropy) {
  check_rows(logits, target);
  const auto dt = float_code(logits, "logits");
  auto stats_dtype = dt == MPPO_F64 ? at::kDouble : at::kFloat;
  std::vector<at::Tensor> rows;
  for (const auto* t : {&log_z, &entropy, &grad_logp, &grad_entropy}) {
    check_cpu(*t, "row statistics");
    TORCH_CHECK(t->dim() == 1 && t->size(0) == logits.size(0), "row statistics must be [N]");
    rows.push_back(t->to(stats_dtype).contiguous());
  }
  auto grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  {
    pybind11::gil_scoped_release no_gil;
    mppo_cpu::lse_backward(logits.data_ptr(), dt, logits.size(0), logits.size(1), logits.stride(0),
                           target.data_ptr<int64_t>(), vocab_start, rows[0].data_ptr(), rows[1].data_ptr(),
                           rows[2].data_ptr(), rows[3].data_ptr(), grad.data_ptr());
  }
  return grad;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ppo CPU kernels: GAE and fused log-prob/entropy (OpenMP)";
  m.def("gae", &gae, "GAE advantages and returns (un-whitened, zero at masked positions)");
  m.def("lse_partials", &lse_partials, "per-row [4, N] (max, sum-exp, sum exp*shifted logit, target logit)");
  m.def("lse_backward", &lse_backward, "grad wrt logits of g_lp*logp + g_ent*entropy");
}
