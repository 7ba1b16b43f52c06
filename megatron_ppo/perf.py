"""Model FLOPs and MFU: one formula for the trainer's per-step metrics (``perf/mfu/<role>``) and the GPU check tool
(testing/gpu_step.py), and the device peaks they are measured against.

MFU is Megatron-LM's and verl's: the model FLOPs of the work done (2 per parameter and token forward, 4 backward;
attention scores left out: a few per cent at RL lengths) over the time and the peak of the GPUs that did it. Peaks
are NVIDIA's dense bf16 datasheet rates (with sparsity they double), so MFU reads against the datasheet, not against
what a GEMM reaches. ``trainer.peak_tflops`` overrides the table (another device, another dtype)."""
from __future__ import annotations

# dense bf16 FLOP/s per GPU by the name torch.cuda.get_device_name() reports (its first match wins: H200 before
# H100, "H100 PCIe" before "H100" where the rates differ)
PEAK_BF16_FLOPS = (
    ("B200", 2250e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
H200_BF16_PEAK_FLOPS = 989e12


def device_peak_flops(device_name: str | None, peak_tflops: float | None = None) -> float | None:
    """The peak FLOP/s of one GPU: ``peak_tflops`` (trainer.peak_tflops) when set, else the table's rate for the
    device's name; None for a device the table does not know (a CPU: MFU is not reported)."""
    if peak_tflops is not None:
        return float(peak_tflops) * 1e12
    if not device_name:
        return None
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def training_flops(n_params: int, tokens: float, passes: int = 1) -> float:
    """Model FLOPs of ``passes`` training passes (forward + backward) over ``tokens``: 6 per parameter and token."""
    return 6.0 * n_params * tokens * passes


def mfu(n_params: int, tokens: float, seconds: float, peak_flops: float = H200_BF16_PEAK_FLOPS, gpus: int = 1,
        passes: int = 1) -> float:
    """6 * params * tokens * passes / seconds / (peak * gpus): the model FLOPs of the training passes over the time,
    as a fraction of the peak of the GPUs that did them."""
    if seconds <= 0 or peak_flops <= 0 or gpus < 1:
        raise ValueError(f"mfu: seconds ({seconds}), peak_flops ({peak_flops}) and gpus ({gpus}) must be positive")
    return training_flops(n_params, tokens, passes) / seconds / (peak_flops * gpus)


def step_model_flops(actor_params: int, critic_params: int, tokens: float, response_tokens: float,
                     actor_epochs: int = 1, critic_epochs: int = 1, reference: bool = True) -> dict[str, float]:
    """Model FLOPs of one PPO step by phase (2 per parameter and token forward, 6 forward + backward):
    generation (prompt prefill + one forward per generated token: ~2 N per token of the rollout), old/ref
    log-probs and values (forwards), the critic's and the actor's updates (epochs x forward + backward)."""
    out = {
        "gen": 2.0 * actor_params * tokens,
        "old_log_prob": 2.0 * actor_params * tokens + (2.0 * actor_params * tokens if reference else 0.0)
        + 2.0 * critic_params * tokens,
        "update_critic": training_flops(critic_params, tokens, critic_epochs),
        "update_actor": training_flops(actor_params, tokens, actor_epochs),
    }
    out["step"] = sum(out.values())
    out["response_tokens"] = float(response_tokens)
    return out


def step_perf_metrics(timings: dict, tokens: float, response_tokens: float, role_params: dict[str, int],
                      role_gpus: dict[str, int], role_passes: dict[str, int], peak_flops: float | None,
                      n_devices: int) -> dict[str, float]:
    """A step's performance metrics from its ``timing/<phase>`` seconds (verl's names where verl has them):
    ``perf/throughput`` tokens per second per device, ``perf/rollout_tokens_per_s`` generated tokens per second of
    ``gen``, and ``perf/mfu/<role>`` for each role that updated this step: 6 x params x tokens x passes (ppo_epochs)
    over its update's time and the peak of its GPUs (none when the peak is unknown: CPU without trainer.peak_tflops)."""
    out: dict[str, float] = {}
    step = timings.get("timing/step", 0.0)
    if step > 0 and n_devices > 0:
        out["perf/throughput"] = tokens / step / n_devices
    if timings.get("timing/gen", 0.0) > 0:
        out["perf/rollout_tokens_per_s"] = response_tokens / timings["timing/gen"]
    if peak_flops:
        for role, params in role_params.items():
            seconds = timings.get(f"timing/update_{role}", 0.0)
            if seconds > 0:
                out[f"perf/mfu/{role}"] = mfu(params, tokens, seconds, peak_flops, role_gpus[role],
                                              role_passes.get(role, 1))
    return out
