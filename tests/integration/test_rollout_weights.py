"""The actor's weights for a rollout engine with its own copy (rollout/weights.py): HF names through the converter's
mapping, bit-identical to the HF checkpoint the actor was loaded from, at TP1, TP2 and PP2; tied embeddings once;
an update reaches the export; a stale version is refused."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_ppo.testing.tiny_hf import make_tiny_hf

KINDS = ("llama", "qwen2", "llama_tied_llama3rope")  # untied; tied + qkv bias; tied + llama3 rope


def _hf_tensors(hf_dir) -> dict:
    import glob

    from safetensors.torch import load_file

    out = {}
    for path in sorted(glob.glob(f"{hf_dir}/*.safetensors")):
        out.update(load_file(path))
    return out


def _assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_tiny_hf(kind, str(root / kind), tokenizer=False) for kind in KINDS}


def _actor(hf_dir):
    from megatron_ppo.convert.hf_import import load_hf_weights
    from megatron_ppo.convert.mapping import arch_from_hf_config
    from megatron_ppo.models.gpt import build_gpt_model

    arch = arch_from_hf_config(hf_dir)
    model = build_gpt_model(arch, "actor")
    load_hf_weights(model, "actor", hf_dir)
    return model, arch


@pytest.mark.parametrize("kind", KINDS)
def test_export_is_the_hf_checkpoint_and_follows_an_update(megatron_single, hf_models, tmp_path, kind):
    from megatron_ppo.rollout.weights import StaleWeightsError, finish_sync, read_weights, write_weights

    hf_dir = hf_models[kind]
    model, arch = _actor(hf_dir)
    want = _hf_tensors(hf_dir)
    files = write_weights(model, str(tmp_path / "sync"), version=1, bucket_bytes=64 << 10)
    assert len(files) > 1  # buckets
    manifest = finish_sync(str(tmp_path / "sync"), 1, files, arch)
    assert manifest["tie_word_embeddings"] == arch.tie_word_embeddings == ("lm_head.weight" not in want)
    got, _ = read_weights(str(tmp_path / "sync"), 1)
    _assert_same(got, want)
    # an update reaches the next version (x2 is exact in fp32 and commutes with every split of the mapping)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    files = write_weights(model, str(tmp_path / "sync"), version=2)  # the same directory: v1 is pruned first
    assert sorted(os.listdir(tmp_path / "sync")) == sorted([os.path.basename(f) for f in files] + ["sync.json"])
    finish_sync(str(tmp_path / "sync"), 2, files, arch)
    got, _ = read_weights(str(tmp_path / "sync"), 2)
    _assert_same(got, {k: 2 * v for k, v in want.items()})
    with pytest.raises(StaleWeightsError, match="holds weights of sync version 2, the actor is at 3"):
        read_weights(str(tmp_path / "sync"), 3)


def test_a_value_model_is_refused(megatron_single):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout.weights import stage_hf_weights

    with pytest.raises(ValueError, match="value model"):
        next(stage_hf_weights(build_gpt_model(tiny_arch(), "critic")))


def test_a_missing_stage_is_refused(megatron_single, hf_models, tmp_path):
    """finish_sync checks the union of the stages' files covers every HF tensor exactly once."""
    import os

    from megatron_ppo.rollout.weights import finish_sync, write_weights

    hf_dir = hf_models["llama"]
    model, arch = _actor(hf_dir)
    files = write_weights(model, str(tmp_path), version=5, bucket_bytes=64 << 10)
    with pytest.raises(ValueError, match="missing"):
        finish_sync(str(tmp_path), 5, files[:-1], arch)
    assert not os.path.exists(tmp_path / "sync.json")


def _job_export(rank, world, layout, hf_dir, out):
    from megatron_ppo import parallel
    from megatron_ppo.rollout.weights import write_weights

    tp, pp = {"tp2": (2, 1), "pp2": (1, 2)}[layout]
    parallel.initialize(tp=tp, pp=pp, seed=7)
    try:
        model, _ = _actor(hf_dir)
        return write_weights(model, out, version=9)
    finally:
        parallel.destroy(destroy_process_group=False)


@pytest.mark.slow  # two ranks
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sharded_actor_exports_the_same_weights(dist_pool2, hf_models, tmp_path, layout, kind):
    from megatron_ppo.convert.mapping import arch_from_hf_config
    from megatron_ppo.rollout.weights import finish_sync, read_weights

    hf_dir = hf_models[kind]
    r0, r1 = dist_pool2.run(_job_export, layout, hf_dir, str(tmp_path))
    if layout == "tp2":
        assert r0 and not r1  # TP rank 1 gathers, rank 0 writes
    else:
        assert r0 and r1  # each stage writes its own layers
    finish_sync(str(tmp_path), 9, r0 + r1, arch_from_hf_config(hf_dir))
    got, _ = read_weights(str(tmp_path), 9)
    _assert_same(got, _hf_tensors(hf_dir))


def _rebuild_elsewhere(buckets) -> dict:
    """The shared buckets as another interpreter on this node rebuilds them (what a vLLM worker does)."""
    import pickle
    import subprocess
    import sys

    script = ("import pickle, sys, torch, torch.multiprocessing as mp\n"
              "from megatron_ppo.rollout.weight_buckets import tensors_of\n"
              "mp.set_sharing_strategy('file_system')\n"
              "out = {}\n"
              "for (fn, args), meta in pickle.loads(sys.stdin.buffer.read()):\n"
              "    out.update({n: t.clone() for n, t in tensors_of(fn(*args), meta)})\n"
              "sys.stdout.buffer.write(pickle.dumps(out))\n")
    out = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(buckets), capture_output=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return pickle.loads(out.stdout)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_shared_buckets_are_the_export_and_never_the_live_parameters(megatron_single, hf_models, kind):
    """weight_transport=ipc: the buckets another process opens hold the HF checkpoint's tensors; changing the model
    afterwards does not change what was shared (a copy, not the parameters); check_complete refuses a repeat or a
    gap."""
    from torch.multiprocessing.reductions import reduce_tensor

    from megatron_ppo.rollout.weight_buckets import stage_buckets
    from megatron_ppo.rollout.weights import check_complete

    hf_dir = hf_models[kind]
    model, arch = _actor(hf_dir)
    buckets = list(stage_buckets(model, 64 << 10, shared=True))
    assert len(buckets) > 1
    handles = [(reduce_tensor(b.flat[:b.used]), b.meta()) for b in buckets]
    names = [n for b in buckets for n in b.names]
    check_complete(names, arch, 1, "test")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    _assert_same(_rebuild_elsewhere(handles), _hf_tensors(hf_dir))
    with pytest.raises(ValueError, match=r"repeated \['model.norm.weight'\]"):
        check_complete(names + ["model.norm.weight"], arch, 1, "test")
    with pytest.raises(ValueError, match="missing"):
        check_complete(names[1:], arch, 1, "test")


def _job_relay(rank, world, layout, hf_dir, owners, bucket_bytes):
    from megatron_ppo import parallel
    from megatron_ppo.rollout.weight_buckets import relay_buckets, tensors_of

    tp, pp = {"tp2": (2, 1), "pp2": (1, 2)}[layout]
    parallel.initialize(tp=tp, pp=pp, seed=7)
    try:
        model, _ = _actor(hf_dir)
        got, sizes = {}, []

        def hand(flat, meta):
            sizes.append(flat.numel())
            got.update({n: t.clone() for n, t in tensors_of(flat, meta)})

        out = relay_buckets(model, bucket_bytes, owners, hand if rank in owners else None)
        return got, sizes, out
    finally:
        parallel.destroy(destroy_process_group=False)


@pytest.mark.slow  # two ranks
@pytest.mark.parametrize("layout,owners", [("tp2", [0]), ("pp2", [1]), ("pp2", [0, 1])])
def test_buckets_relayed_over_the_pipeline_reach_every_owner_one_bucket_at_a_time(dist_pool2, hf_models, layout,
                                                                                  owners):
    """weight_transport=ipc's path without vLLM: every engine owner of a replica (the last stage's first TP rank;
    with an engine per node, every stage's) receives every HF tensor of the checkpoint exactly, the other stages'
    by point-to-point relay; TP shards are gathered to the first TP rank only; no bucket is larger than the bucket
    size or the largest single tensor."""
    hf_dir = hf_models["llama"]
    want = _hf_tensors(hf_dir)
    bucket = 48 << 10
    largest = max(t.numel() * t.element_size() for t in want.values())
    results = dist_pool2.run(_job_relay, layout, hf_dir, owners, bucket)
    for rank, (got, sizes, out) in enumerate(results):
        if rank not in owners:
            assert not got and not sizes and out == {"names": [], "peak_bucket_bytes": 0} or not got, rank
            continue
        _assert_same(got, want)
        assert len(sizes) > 2 and max(sizes) <= max(bucket, largest), (rank, sizes)
        assert sorted(out["names"]) == sorted(want)
