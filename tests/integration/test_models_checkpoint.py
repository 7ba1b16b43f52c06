"""dist_checkpointing: save at one layout, load at another (TP1->TP2, PP1->PP2, TP2->PP2): identical outputs.

Optimizer state (issue 47): the distributed optimizer's per-shard writer and reader (models/optimizer_state.py)
against megatron-core's own gathering fully_reshardable format (the same tensors, element for element; old
checkpoints load), resume bit-exactness, the state resharded to TP2 and PP2, and both Adams megatron builds on CPU
(torch Adam, AdamW). Tiny model, in-process ranks."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch

pytestmark = pytest.mark.slow

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _outputs(model, vocab):
    """Full-vocab logits or values of a fixed packed batch, on the last stage (None elsewhere)."""
    from megatron_ppo.models.forward import pack_sequences
    from megatron_ppo.models.schedule import forward_backward
    from megatron_ppo.testing.sharding import gather_full_state_dict

    g = torch.Generator().manual_seed(8)
    ids, cu = pack_sequences([torch.randint(0, vocab, (n,), generator=g) for n in (6, 9, 3)])
    def full_vocab(o, b):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        o = o.detach()
        if o.shape[-1] > 1:  # vocab-parallel logits (values are replicated over TP)
            o = gather_from_tensor_model_parallel_region(o)
        return o.sum() * 0, {"out": o}

    out = forward_backward([model], [{"input_ids": ids, "cu_seqlens": cu}], full_vocab, forward_only=True)
    weights = gather_full_state_dict(model)
    return (out[0]["out"] if out else None), weights


def _job(rank, world, ckpt_dir, role, save_layout, load_layout):
    import torch.distributed as dist

    from megatron_ppo import parallel
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.checkpoint import load_checkpoint, save_checkpoint
    from megatron_ppo.models.gpt import build_gpt_model

    arch = tiny_arch(tie_word_embeddings=role == "actor")
    tp, pp = LAYOUTS[save_layout]
    parallel.initialize(tp=tp, pp=pp, seed=3)
    try:
        model = build_gpt_model(arch, role)
        ref, ref_w = _outputs(model, arch.vocab_size)
        save_checkpoint(model, ckpt_dir)
    finally:
        parallel.destroy(destroy_process_group=False)
    tp, pp = LAYOUTS[load_layout]
    parallel.initialize(tp=tp, pp=pp, seed=77)
    try:
        model = build_gpt_model(arch, role)
        fresh, _ = _outputs(model, arch.vocab_size)
        meta = load_checkpoint(model, ckpt_dir)
        got, got_w = _outputs(model, arch.vocab_size)
    finally:
        parallel.destroy(destroy_process_group=False)
    objs = [None, None]
    dist.all_gather_object(objs, ref)  # the saving layout's last stage may be another rank
    ref = next(o for o in objs if o is not None)
    result = {"meta": meta, "weights": max((ref_w[k] - got_w[k]).abs().max().item() for k in ref_w)}
    if got is not None:
        assert ref.shape == got.shape, (ref.shape, got.shape)
        result["out"] = (ref - got).abs().max().item()
        result["fresh_differs"] = not torch.allclose(fresh, ref)
    return result


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("save_layout,load_layout", [("tp1", "tp2"), ("tp1", "pp2"), ("tp2", "pp2")])
def test_save_one_layout_load_another(dist_pool2, tmp_path, role, save_layout, load_layout):
    ckpt = str(tmp_path / "ckpt")
    results = dist_pool2.run(_job, ckpt, role, save_layout, load_layout)
    assert os.path.isdir(ckpt) and not os.path.exists(ckpt + ".tmp")
    assert results[0]["meta"]["saved_layout"]["tp"] == LAYOUTS[save_layout][0]
    outs = [r for r in results if "out" in r]
    assert outs
    for r in results:
        assert r["weights"] == 0.0
    for r in outs:
        assert r["out"] <= 1e-6, r
        assert r["fresh_differs"]  # the loaded model was not already equal by construction


# Hidden 48: at DP2 the cut between the two ranks' shards falls mid-row (in linear_qkv, 96 x 48, after 14 rows and
# 32 elements): each rank writes and reads that parameter's state as two boxes
ARCH = tiny_arch(tie_word_embeddings=True, hidden_size=48, ffn_hidden_size=80)


def _build(use_distributed_optimizer=True, decoupled_weight_decay=True, seed_shift=0):
    """A tied-embedding actor in megatron DDP with megatron's Adam (torch AdamW, or Adam without decoupled decay)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.training import wrap_ddp

    torch.manual_seed(100 + seed_shift)
    model = build_gpt_model(ARCH, "actor")
    ddp = wrap_ddp(model, use_distributed_optimizer=use_distributed_optimizer)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                             decoupled_weight_decay=decoupled_weight_decay,
                             use_distributed_optimizer=use_distributed_optimizer)
    return model, ddp, get_megatron_optimizer(config, [ddp])


def _step(ddp, optimizer, step: int) -> None:
    """One optimizer step on gradients drawn from (step, rank): no forward needed to exercise the state."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * step + (dist.get_rank() if dist.is_initialized() else 0))
    for buffer in ddp.buffers:
        buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, generator=g))
    assert optimizer.step()[0]


def _snapshot(model, optimizer) -> dict:
    """This rank's weights and optimizer tensors (the step included), cloned."""
    out = {f"w.{k}": v.detach().clone() for k, v in model.named_parameters()}
    for i, (_, inner) in enumerate(_inners(optimizer)):
        for j, p in enumerate(p for group in inner.param_groups for p in group["params"]):
            out[f"main.{i}.{j}"] = p.detach().clone()
            out.update({f"state.{i}.{j}.{k}": v.detach().clone() for k, v in inner.state[p].items()})
    return out


def _inners(optimizer):
    from megatron_ppo.models.checkpoint import _inner_optimizers

    return _inner_optimizers(optimizer)


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


@contextlib.contextmanager
def _megatron_gather():
    """save_checkpoint as it was before issue 47: megatron-core's own fully_reshardable save (a gather)."""
    from megatron_ppo.models import checkpoint

    original = checkpoint.optimizer_state.per_shard
    checkpoint.optimizer_state.per_shard = lambda optimizer: contextlib.nullcontext()
    try:
        yield
    finally:
        checkpoint.optimizer_state.per_shard = original


@contextlib.contextmanager
def _no_gather(optimizer):
    """Fails the save or load that gathers the DP group's optimizer state (megatron's fully_reshardable builders
    call get_parameter_state_dp_zero for the gather, and for the whole-state buffers of a load)."""
    from megatron_ppo.models import optimizer_state

    def gather(*args, **kwargs):
        raise AssertionError("the DP group's optimizer state was gathered")

    opts = optimizer_state.distributed_optimizers(optimizer)
    for opt in opts:
        opt.get_parameter_state_dp_zero = gather
    try:
        yield
    finally:
        for opt in opts:
            del opt.get_parameter_state_dp_zero


def _plain(directory: str) -> dict:
    from megatron.core import dist_checkpointing

    return {k: v for k, v in dist_checkpointing.load_plain_tensors(directory).items() if k.startswith("optimizer.")}


def _dp2_job(rank, world, root):
    """DP2: two steps, save per shard (new) and gathered (old), a third step as the reference; a fresh model loads
    each and takes the same third step; then the DP2 checkpoint is loaded at TP2 and at PP2 and saved again there."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ppo import parallel
    from megatron_ppo.models import optimizer_state
    from megatron_ppo.models.checkpoint import load_checkpoint, save_checkpoint

    out = {}
    parallel.initialize(tp=1, pp=1, seed=3)
    try:
        model, ddp, optimizer = _build()
        _step(ddp, optimizer, 1)
        _step(ddp, optimizer, 2)
        (opt,) = optimizer_state.distributed_optimizers(optimizer)
        shard = optimizer_state._shard_params(opt, model.sharded_state_dict())
        # the DP boundary cuts a plain parameter mid-row: its state is written as several boxes
        out["boxes"] = max(len(optimizer_state._boxes(sh, "k", torch.zeros(len(opt._get_model_param_range_map(p)[
            "param"])), start, (0, 0, 0))) for p, sh, start in shard if isinstance(sh, ShardedTensor))
        with _no_gather(optimizer):
            save_checkpoint(model, f"{root}/new", optimizer)
        with _megatron_gather():
            save_checkpoint(model, f"{root}/old", optimizer)
        _step(ddp, optimizer, 3)
        straight = _snapshot(model, optimizer)
        for name in ("new", "old"):
            model, ddp, optimizer = _build(seed_shift=1)
            with _no_gather(optimizer):  # the old checkpoint too: read per shard
                load_checkpoint(model, f"{root}/{name}", optimizer)
            _step(ddp, optimizer, 3)
            _assert_equal(straight, _snapshot(model, optimizer))
        new, old = _plain(f"{root}/new"), _plain(f"{root}/old")  # collective: every rank reads
        assert new.keys() == old.keys() and len(new) > 0
        assert {k.split(".")[2] for k in new} == {"param", "exp_avg", "exp_avg_sq"}
        _assert_equal(new, old)
    finally:
        parallel.destroy(destroy_process_group=False)
    for name, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():
        parallel.initialize(tp=tp, pp=pp, seed=4)
        try:
            model, ddp, optimizer = _build(seed_shift=2)
            load_checkpoint(model, f"{root}/new", optimizer)
            save_checkpoint(model, f"{root}/{name}", optimizer)
        finally:
            parallel.destroy(destroy_process_group=False)
        _assert_equal(_plain(f"{root}/new"), _plain(f"{root}/{name}"))
    return out


def test_per_shard_state_equals_megatrons_gather_resumes_bit_exactly_and_reshards(dist_pool2, tmp_path):
    results = dist_pool2.run(_dp2_job, str(tmp_path))
    assert all(r["boxes"] > 1 for r in results)


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "ddp"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_torch_adam_and_adamw_resume_bit_exactly(megatron_single, tmp_path, distributed, decoupled):
    """Both of the Adams megatron builds without TE/apex, saved after a step and saved never stepped."""
    from megatron_ppo.models.checkpoint import load_checkpoint, save_checkpoint

    model, ddp, optimizer = _build(distributed, decoupled_weight_decay=decoupled)
    (_, inner), = _inners(optimizer)
    assert type(inner) is (torch.optim.AdamW if decoupled else torch.optim.Adam)
    save_checkpoint(model, str(tmp_path / "fresh"), optimizer)  # never stepped (trainer.critic_warmup)
    _step(ddp, optimizer, 1)
    save_checkpoint(model, str(tmp_path / "stepped"), optimizer)
    _step(ddp, optimizer, 2)
    straight = _snapshot(model, optimizer)
    model, ddp, optimizer = _build(distributed, decoupled_weight_decay=decoupled, seed_shift=1)
    load_checkpoint(model, str(tmp_path / "stepped"), optimizer)
    _step(ddp, optimizer, 2)
    _assert_equal(straight, _snapshot(model, optimizer))
    steps = [s["step"] for s in inner.state.values()]
    assert len({id(s) for s in steps}) == len(steps)  # one step tensor per parameter (torch increments in place)
