"""dist_checkpointing: save at one layout, load at another (TP1->TP2, PP1->PP2, TP2->PP2): identical outputs."""
from __future__ import annotations

import os

import pytest
import torch

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
