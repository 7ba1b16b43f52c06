"""``<role>.model.cpu_gemm``: a MegatronWorker with oneDNN GEMMs (cpu_gemm=onednn) computes what the torch/MKL one does
to fp32 rounding (log-probs, loss, gradient norm, the weights after an Adam step, a rollout), its forward, backward
and prefill GEMMs really go to oneDNN, and ``cpu_gemm=torch`` sends none there. Real megatron-core, one rank."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ppo.ops import cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.onednn_available(), reason="no oneDNN linear op in this torch")


@pytest.fixture
def routed(monkeypatch):
    calls = []
    real = cpu_matmul.onednn_mm

    def spy(a, b, bias=None):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, bias)

    monkeypatch.setattr(cpu_matmul, "onednn_mm", spy)
    return calls


def _workers():
    from megatron_ppo import parallel
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    optim = SimpleNamespace(lr=1e-2, weight_decay=0.01, betas=[0.9, 0.999], clip_grad=0.0, lr_warmup_steps=0,
                            lr_warmup_steps_ratio=0.0, lr_warmup_init=0.0, lr_decay_steps=None,
                            lr_decay_style="constant", min_lr=0.0)
    out = {}
    for gemm in ("torch", "onednn"):
        parallel.seed_everything(7)
        out[gemm] = MegatronWorker("actor", tiny_arch(), optim=optim, cpu_gemm=gemm)
    return out


def _micros():
    from megatron_ppo.models.forward import pack_sequences

    g = torch.Generator().manual_seed(3)
    ids, cu = pack_sequences([torch.randint(0, 512, (n,), generator=g) for n in (23, 9, 17)])
    return [{"input_ids": ids, "cu_seqlens": cu}]


def _log_probs(logits, micro):
    lp = torch.log_softmax(logits.float(), dim=-1)[0, :-1]
    return lp.gather(-1, micro["input_ids"][0, 1:, None]).squeeze(-1)


def _loss(logits, micro):
    loss = -_log_probs(logits, micro).mean()
    return loss, {"nll": loss.detach()}


def test_onednn_worker_matches_torch_and_really_routes(megatron_single, routed):
    workers = _workers()
    tokens = _micros()[0]["input_ids"].numel()
    out, steps = {}, {}
    for gemm, worker in workers.items():
        routed.clear()
        out[gemm] = worker.forward(_micros(), lambda logits, micro: {"lp": _log_probs(logits, micro)})[0]["lp"]
        n_forward = len(routed)
        steps[gemm] = worker.train_step(_micros(), _loss)
        n_train = len(routed) - n_forward
        if gemm == "torch":
            assert routed == []
        else:  # 2 layers x (qkv, proj, fc1, fc2) + the LM head, forward; and the backward's GEMMs too
            assert n_forward == 9, routed
            weight_grads = [c for c in routed[n_forward:] if c[0][1] == tokens]  # dY^T [N, T] @ X [T, K]
            assert n_train == 3 * 9 and len(weight_grads) == 9, routed[n_forward:]
    torch.testing.assert_close(out["onednn"], out["torch"], rtol=0, atol=1e-5)
    assert steps["onednn"]["loss"] == pytest.approx(steps["torch"]["loss"], rel=1e-6)
    assert steps["onednn"]["grad_norm"] == pytest.approx(steps["torch"]["grad_norm"], rel=1e-5)
    # Adam's first step moves every weight by ~lr * sign(grad): a wrong gradient shows as a ~1e-2 difference, a
    # rounding-level one only where a gradient element is near zero
    params = {g: dict(w.model.named_parameters()) for g, w in workers.items()}
    for name, p in params["torch"].items():
        torch.testing.assert_close(params["onednn"][name], p, rtol=0, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_rollout_prefill_follows_the_role_choice(megatron_single, routed):
    from megatron_ppo.rollout.generation import SamplingParams
    from megatron_ppo.rollout.megatron import MegatronEngine

    workers = _workers()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (11, 6, 8)]
    params = SamplingParams(max_response_length=6, greedy=True)
    results = {}
    for gemm, worker in workers.items():
        routed.clear()
        results[gemm] = MegatronEngine.for_worker(worker).generate(prompts, params)
        assert (len(routed) > 0) == (gemm == "onednn"), (gemm, routed)
    assert torch.equal(results["onednn"].responses, results["torch"].responses)
    torch.testing.assert_close(results["onednn"].log_probs, results["torch"].log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("hidden, routed_expected", [(64, False), (512, True)])
def test_rollout_prefill_follows_auto(megatron_single, routed, hidden, routed_expected):
    """Under cpu_gemm=auto (the default) a model below hidden size 512 generates with its prefill on torch's GEMMs
    (nothing reaches oneDNN's mm: the decode step's prepacked weights do not go through it); from 512 up the prefill
    is routed. The worker's own onednn decision is what generate follows, not SamplingParams' default."""
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.rollout.generation import SamplingParams
    from megatron_ppo.rollout.megatron import MegatronEngine
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    arch = tiny_arch(hidden_size=hidden, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * hidden,
                     num_layers=1)
    worker = MegatronWorker("actor", arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (11, 6, 8)]
    routed.clear()
    MegatronEngine.for_worker(worker).generate(prompts, SamplingParams(max_response_length=4, greedy=True))
    assert (len(routed) > 0) is routed_expected, routed


def test_unknown_cpu_gemm_is_refused(megatron_single):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    with pytest.raises(ValueError, match="cpu_gemm must be 'auto', 'onednn' or 'torch', got 'mkl'"):
        MegatronWorker("actor", tiny_arch(), cpu_gemm="mkl")


@pytest.mark.parametrize("hidden, routed_expected", [(64, False), (512, True)])
def test_auto_routes_from_hidden_size_512(megatron_single, hidden, routed_expected):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    arch = tiny_arch(hidden_size=hidden, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * hidden,
                     num_layers=1)
    assert MegatronWorker("actor", arch).onednn is routed_expected  # "auto" is the default
    assert MegatronWorker("actor", arch, cpu_gemm="onednn").onednn
    assert not MegatronWorker("actor", arch, cpu_gemm="torch").onednn
