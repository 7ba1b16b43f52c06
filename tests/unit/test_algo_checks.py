"""Bad input for every public algo function: shape mismatch, wrong dtypes, non-0/1 masks, NaN/inf at valid
positions -> ValueError naming the argument; empty masks -> the documented result; and import hygiene."""
import ast
import pathlib
import subprocess
import sys

import pytest
import torch

from megatron_ppo.algo import advantages as A
from megatron_ppo.algo import checks
from megatron_ppo.algo import kl_control as K
from megatron_ppo.algo import losses as L
from megatron_ppo.algo import rollout_correction as R

B, T = 3, 5
TENSOR = "tensor"
MASK = "mask"


def _tensor():
    return torch.rand(B, T)


def _mask():
    return torch.ones(B, T)


# name -> (function, {arg: TENSOR | MASK | fixed value}, documented result for an all-zero mask)
CASES = {
    "gae": (A.compute_gae_advantage_return,
            dict(token_level_rewards=TENSOR, values=TENSOR, response_mask=MASK, gamma=1.0, lam=0.95), "zeros"),
    "grpo": (A.compute_grpo_outcome_advantage,
             dict(token_level_rewards=TENSOR, response_mask=MASK, index=["a", "a", "b"]), "zeros"),
    "masked_mean": (A.masked_mean, dict(values=TENSOR, mask=MASK), "zeros"),
    "masked_var": (A.masked_var, dict(values=TENSOR, mask=MASK), "zeros"),
    "masked_whiten": (A.masked_whiten, dict(values=TENSOR, mask=MASK), "identity"),
    "agg_loss": (L.agg_loss, dict(loss_mat=TENSOR, loss_mask=MASK, loss_agg_mode="seq-mean-token-mean"), "zeros"),
    "policy_loss": (L.compute_policy_loss,
                    dict(old_log_prob=TENSOR, log_prob=TENSOR, advantages=TENSOR, response_mask=MASK,
                         rollout_is_weights=TENSOR), "zeros"),
    "value_loss": (L.compute_value_loss,
                   dict(vpreds=TENSOR, returns=TENSOR, values=TENSOR, response_mask=MASK, cliprange_value=0.5),
                   "zeros"),
    "explained_variance": (L.explained_variance, dict(values=TENSOR, returns=TENSOR, response_mask=MASK), "zeros"),
    "kl_penalty": (L.kl_penalty, dict(logprob=TENSOR, ref_logprob=TENSOR, kl_penalty="k3", response_mask=MASK),
                   "any"),
    "is_weights": (R.compute_rollout_correction_weights, dict(log_ratio=TENSOR, response_mask=MASK), "raises"),
    "rejection": (R.compute_rollout_rejection_mask,
                  dict(log_ratio=TENSOR, response_mask=MASK, rollout_rs="token_k2", rollout_rs_threshold=1.0),
                  "raises"),
    "offpolicy": (R.compute_offpolicy_metrics,
                  dict(old_log_prob=TENSOR, rollout_log_prob=TENSOR, response_mask=MASK), "raises"),
    "rollout_correction": (R.compute_rollout_correction_and_rejection_mask,
                           dict(old_log_prob=TENSOR, rollout_log_prob=TENSOR, response_mask=MASK,
                                rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=2.0), "raises"),
    "apply_kl_penalty": (K.apply_kl_penalty,
                         dict(token_level_scores=TENSOR, old_log_prob=TENSOR, ref_log_prob=TENSOR, response_mask=MASK,
                              kl_ctrl=K.FixedKLController(0.1)), "any"),
}


def build(name, **override):
    fn, spec, _ = CASES[name]
    kwargs = {k: _tensor() if v is TENSOR else _mask() if v is MASK else v for k, v in spec.items()}
    kwargs.update(override)
    return fn, kwargs


def args_of(kind):
    return [(name, arg) for name, (_, spec, _) in CASES.items() for arg, v in spec.items() if v is kind]


@pytest.mark.parametrize("name,arg", args_of(TENSOR) + args_of(MASK))
def test_shape_mismatch_names_the_argument(name, arg):
    fn, kwargs = build(name)
    kwargs[arg] = kwargs[arg][:, :-1]
    with pytest.raises(ValueError, match=arg):
        fn(**kwargs)


@pytest.mark.parametrize("name,arg", args_of(TENSOR))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_at_valid_positions_is_an_error_and_ignored_elsewhere(name, arg, bad):
    fn, kwargs = build(name)
    kwargs[arg][1, 2] = bad
    with pytest.raises(ValueError, match=arg):
        fn(**kwargs)
    fn, kwargs = build(name)
    kwargs[arg][1, 2] = bad
    mask_arg = next(a for a, v in CASES[name][1].items() if v is MASK)
    kwargs[mask_arg][1, 2] = 0
    out = fn(**kwargs)  # masked positions may hold anything
    tensors = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    for o in tensors:
        if o.dim() == 2:
            assert torch.isfinite(o[kwargs[mask_arg].bool()]).all()
        else:
            assert torch.isfinite(o).all()


@pytest.mark.parametrize("name,arg", args_of(TENSOR))
def test_non_float_or_non_tensor_values_name_the_argument(name, arg):
    for bad in (torch.ones(B, T, dtype=torch.long), [[0.0] * T] * B):
        fn, kwargs = build(name)
        kwargs[arg] = bad
        with pytest.raises(ValueError, match=arg):
            fn(**kwargs)


@pytest.mark.parametrize("name,arg", args_of(MASK))
def test_bad_masks_name_the_argument(name, arg):
    bad_masks = [torch.ones(B, T, dtype=torch.complex64), torch.full((B, T), 0.5), torch.full((B, T), 2),
                 torch.full((B, T), float("nan")), [[1] * T] * B]
    for bad in bad_masks:
        fn, kwargs = build(name)
        kwargs[arg] = bad
        with pytest.raises(ValueError, match=arg):
            fn(**kwargs)
    for good in (torch.ones(B, T, dtype=torch.bool), torch.ones(B, T, dtype=torch.int32),
                 torch.ones(B, T, dtype=torch.bfloat16)):
        fn, kwargs = build(name)
        kwargs[arg] = good
        fn(**kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_all_zero_mask_has_the_documented_result(name):
    fn, spec, expected = CASES[name]
    fn, kwargs = build(name)
    mask_arg = next(a for a, v in spec.items() if v is MASK)
    kwargs[mask_arg] = torch.zeros(B, T)
    if expected == "raises":
        with pytest.raises(ValueError, match="response_mask"):
            fn(**kwargs)
        return
    out = fn(**kwargs)
    tensors = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    for o in tensors:
        assert not torch.isnan(o).any()
        if expected == "zeros":
            assert (o == 0).all(), name
        if expected == "identity":
            assert torch.equal(o, kwargs["values"])


def test_value_checks_can_be_switched_off():
    fn, kwargs = build("agg_loss")
    kwargs["loss_mat"][0, 0] = float("nan")
    previous = checks.set_value_checks(False)
    try:
        assert torch.isnan(fn(**kwargs))  # unchecked: the caller asked for speed over safety
    finally:
        checks.set_value_checks(previous)
    with pytest.raises(ValueError, match="loss_mat"):
        fn(**kwargs)


def test_algo_never_imports_distributed_megatron_or_ray():
    root = pathlib.Path(__file__).resolve().parents[2] / "megatron_ppo" / "algo"
    banned = ("torch.distributed", "megatron", "ray", "verl")
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert not any(n == b or n.startswith(b + ".") for b in banned), f"{path.name} imports {n}"
            if isinstance(node, ast.Attribute) and node.attr == "distributed":
                raise AssertionError(f"{path.name} uses *.distributed")
    code = ("import sys, megatron_ppo.algo.advantages, megatron_ppo.algo.losses, megatron_ppo.algo.kl_control, "
            "megatron_ppo.algo.rollout_correction; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'megatron', 'verl')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
