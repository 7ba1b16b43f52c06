// Argument checks and tensor plumbing shared by the CPU and CUDA torch bindings (the only files that see ATen).
// Device checks stay in each binding (CPU tensors vs tensors on the logits' CUDA device); everything here is
// device-independent: shapes, dtypes, the mppo_logits description, the row statistics and the gradient buffer.
#pragma once
#include <torch/extension.h>

#include <vector>

#include "../types.h"

namespace mppo_bind {

inline mppo_dtype float_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return MPPO_F32;
    case at::kDouble: return MPPO_F64;
    case at::kBFloat16: return MPPO_BF16;
    default: TORCH_CHECK(false, name, " must be float32, float64 or bfloat16, got ", t.scalar_type());
  }
  return MPPO_F32;
}

// Statistics are float64 for float64 logits, float32 otherwise.
inline at::ScalarType stats_dtype(mppo_dtype logits_dtype) {
  return logits_dtype == MPPO_F64 ? at::kDouble : at::kFloat;
}

inline void check_gae_shapes(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask) {
  TORCH_CHECK(rewards.dim() == 2, "token_level_rewards must be [B, T], got ", rewards.sizes());
  TORCH_CHECK(values.sizes() == rewards.sizes() && mask.sizes() == rewards.sizes(),
              "values and response_mask must have token_level_rewards' shape ", rewards.sizes());
}

// A contiguous 0/1 mask of any bool, integer or floating dtype -> the kernels' raw-bits view of it (types.h).
inline mppo_mask mask_view(const at::Tensor& m, const char* name) {
  TORCH_CHECK(m.is_contiguous(), name, " must be contiguous here");
  switch (m.scalar_type()) {
    case at::kBool:
    case at::kByte:
    case at::kChar: return {m.data_ptr(), 1, 0xffu, 1u};
    case at::kShort: return {m.data_ptr(), 2, 0xffffu, 1u};
    case at::kInt: return {m.data_ptr(), 4, 0xffffffffu, 1u};
    case at::kLong: return {m.data_ptr(), 8, ~uint64_t{0}, 1u};
    case at::kHalf: return {m.data_ptr(), 2, 0x7fffu, 0x3c00u};
    case at::kBFloat16: return {m.data_ptr(), 2, 0x7fffu, 0x3f80u};
    case at::kFloat: return {m.data_ptr(), 4, 0x7fffffffu, 0x3f800000u};
    case at::kDouble: return {m.data_ptr(), 8, 0x7fffffffffffffffull, 0x3ff0000000000000ull};
    default: TORCH_CHECK(false, name, " must be a bool, integer or floating 0/1 mask, got ", m.scalar_type());
  }
  return {};
}

// logits [N, V_local] (V_local > 0, contiguous in the vocabulary dim) and target_ids [N] int64 -> the kernels'
// view of them. The caller has checked their devices.
inline mppo_logits describe(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start,
                            double inv_temperature) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [N, V_local], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) == 0 || logits.stride(1) == 1, "logits must be contiguous in the vocabulary dim");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "target_ids must be [N] with N = ",
              logits.size(0), ", got ", target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous(), "target_ids must be contiguous int64");
  TORCH_CHECK(logits.size(1) > 0, "logits must have a non-empty vocabulary dim");
  TORCH_CHECK(inv_temperature > 0, "inv_temperature must be > 0");
  return {logits.data_ptr(), float_code(logits, "logits"), logits.size(0), logits.size(1), logits.stride(0),
          target.data_ptr<int64_t>(), vocab_start, inv_temperature};
}

// The four [N] row vectors of the backward (log_z, entropy, grad_logp, grad_entropy), contiguous in the
// statistics dtype. The caller has checked their devices.
inline std::vector<at::Tensor> row_statistics(const mppo_logits& in, const std::vector<const at::Tensor*>& rows) {
  std::vector<at::Tensor> out;
  for (const auto* t : rows) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == in.n_rows, "row statistics must be [N]");
    out.push_back(t->to(stats_dtype(in.dtype)).contiguous());
  }
  return out;
}

// Where the backward writes: ``out`` when given (e.g. a view of the logits themselves: in-place), else a new
// contiguous tensor like the logits.
inline at::Tensor grad_buffer(const at::Tensor& logits, const c10::optional<at::Tensor>& out) {
  if (!out.has_value()) return at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor& grad = *out;
  TORCH_CHECK(grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type() &&
                  grad.device() == logits.device() && grad.stride(1) == 1,
              "out must have the logits' shape, dtype and device, contiguous in the vocabulary dim");
  // Rows are written concurrently; the logits are only read, so their rows may overlap (e.g. expanded), out's not.
  TORCH_CHECK(grad.size(0) <= 1 || grad.stride(0) >= grad.size(1), "out's rows must not overlap (stride(0) = ",
              grad.stride(0), " < V = ", grad.size(1), ")");
  return grad;
}

}  // namespace mppo_bind
