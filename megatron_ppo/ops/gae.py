"""GAE front door: the compiled kernel for the tensors' device, else ``algo.advantages.compute_gae_advantage_return``.

Same arguments, checks and semantics as the algo function (verl's reverse recursion with masked steps skipped,
un-whitened, zero at masked positions, returns = advantages + values at valid positions, output dtype
promote_types(rewards, values)). One numerical difference: the kernels accumulate in float64 (CPU) / float32
(GPU) and round once at the end, where the torch loop rounds every step in the output dtype; the two agree to
rounding for float32 and the kernel is the more accurate for bfloat16 (docs/kernels.md).
The kernels take the mask in its own dtype (bool, integer or floating, e.g. the trainer's float response_mask) and
count NaN/inf inputs and non-0/1 mask entries in the same pass as the recursion: all value checks cost one host
sync and no extra pass over the inputs.
"""
from __future__ import annotations

import os

import torch

from megatron_ppo.algo import checks
from megatron_ppo.ops import _backend, reference

_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# masks the kernels read as they are (0/1 validated in the kernel's pass; csrc/common/torch_bindings.h mask_view)
_KERNEL_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                       torch.bfloat16, torch.float32, torch.float64)
GAE_CUDA_ALGOS = {"auto": 0, "serial": 1, "scan": 2}


def gae(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma, lam
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) over [batch, response_length], un-whitened; see module docstring."""
    kernels = _backend.kernels_for(getattr(token_level_rewards, "device", torch.device("cpu")), "gae")
    if kernels is None:
        return reference.gae(token_level_rewards, values, response_mask, gamma, lam)
    checks.float_tensor(token_level_rewards, "token_level_rewards", ndim=2)
    checks.float_like(values, "values", "token_level_rewards", token_level_rewards)
    checks.mask_metadata(response_mask, "response_mask", "token_level_rewards", token_level_rewards)
    gamma = checks.real_number(gamma, "gamma", low=0.0, high=1.0)
    lam = checks.real_number(lam, "lam", low=0.0, high=1.0)
    for name, t in (("values", values), ("response_mask", response_mask)):
        if t.device != token_level_rewards.device:
            raise ValueError(f"{name} is on {t.device} but token_level_rewards on {token_level_rewards.device}")
    out_dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
    if token_level_rewards.dtype not in _KERNEL_DTYPES or values.dtype not in _KERNEL_DTYPES:
        return reference.gae(token_level_rewards, values, response_mask, gamma, lam)  # e.g. float16
    rewards, vals, mask = token_level_rewards.detach(), values.detach(), response_mask.detach()
    if mask.dtype not in _KERNEL_MASK_DTYPES:  # e.g. float8: the multi-pass check, then a bool mask
        mask = checks.mask(mask, "response_mask", "token_level_rewards", token_level_rewards)
    if rewards.device.type == "cuda":
        algo = GAE_CUDA_ALGOS[_cuda_algo()]
        advantages, returns, counts = kernels.gae(rewards, vals, mask, gamma, lam, out_dtype, algo)
    else:
        advantages, returns, counts = kernels.gae(rewards, vals, mask, gamma, lam, out_dtype)
    if checks.value_checks_enabled():  # algo's value checks, counted inside the kernel's one pass: one host sync
        bad_rewards, bad_values, bad_mask = counts.tolist()
        if bad_mask:
            checks.raise_not_01(response_mask, "response_mask")
        for name, count in (("token_level_rewards", bad_rewards), ("values", bad_values)):
            if count:
                raise ValueError(f"{name} has {count} NaN/inf values at valid (mask=1) positions")
    return advantages, returns


def _cuda_algo() -> str:
    """MEGATRON_PPO_GAE_CUDA_ALGO = auto | serial | scan (benchmarks compare them; auto is the measured choice)."""
    value = os.environ.get("MEGATRON_PPO_GAE_CUDA_ALGO", "auto").strip().lower()
    if value not in GAE_CUDA_ALGOS:
        raise ValueError(f"MEGATRON_PPO_GAE_CUDA_ALGO must be one of {list(GAE_CUDA_ALGOS)}, got {value!r}")
    return value
