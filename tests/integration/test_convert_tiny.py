"""HF <-> Megatron conversion on tiny random Llama / Qwen2 models made with transformers (no download).

HF -> Megatron at (TP, PP) in {(1,1), (2,1), (1,2)}: the Megatron model's logits equal HF's (fp32, max abs diff
<= 1e-4) on the same tokens; Megatron -> HF: every tensor bit-identical to the original. The checkpoints are
loaded with megatron's ``dist_checkpointing.load`` in strict mode (no missing and no unexpected keys).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ppo.convert.cli import main as convert_main
from megatron_ppo.convert.mapping import arch_from_hf_config
from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf
from megatron_ppo.convert.verify import load_dist_checkpoint, megatron_logits
from megatron_ppo.testing.conversion import compare_hf_checkpoints
from megatron_ppo.testing.tiny_hf import TINY_KINDS as KINDS, TINY_VOCAB as VOCAB, make_tiny_hf

TOL = 1e-4


def hf_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def sample_tokens(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 24), generator=g)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {kind: make_tiny_hf(kind, str(root / kind)) for kind in KINDS}


def assert_same_files(src: str, dst: str, names=("tokenizer.json", "tokenizer_config.json", "generation_config.json")):
    for name in names:
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "rb") as b:
            assert a.read() == b.read(), name


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_pp1_logits_match_hf_and_round_trip_is_bit_exact(kind, tiny_models, tmp_path, megatron_single):
    from megatron_ppo.models.gpt import build_gpt_model

    hf_dir = tiny_models[kind]
    report = hf_to_mcore(hf_dir, str(tmp_path / "mcore"), tp=1, pp=1, quiet=True)
    assert report.ledger["params_in"] + report.ledger["padding_added"] == report.ledger["params_out"]

    arch = arch_from_hf_config(hf_dir)
    model = build_gpt_model(arch).eval()
    load_dist_checkpoint(model, str(tmp_path / "mcore"), strict=True)
    ids = sample_tokens()
    diff = (megatron_logits(model, ids, VOCAB) - hf_logits(hf_dir, ids)).abs().max().item()
    assert diff <= TOL, f"{kind}: max |logit diff| {diff:.3g}"

    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "hf_back"), quiet=True)
    assert compare_hf_checkpoints(hf_dir, str(tmp_path / "hf_back")) == []
    assert_same_files(hf_dir, str(tmp_path / "hf_back"),
                      names=("config.json", "tokenizer.json", "tokenizer_config.json"))


def test_checkpoint_written_at_tp2_loads_at_tp1(tiny_models, tmp_path, megatron_single):
    """Reshardable: TP=2 pads the vocab to 512 rows and cuts every tensor in two; a TP=1 model (384 rows) loads it."""
    from megatron_ppo.models.gpt import build_gpt_model

    hf_dir = tiny_models["qwen2"]
    hf_to_mcore(hf_dir, str(tmp_path / "mcore"), tp=2, pp=1, quiet=True)
    model = build_gpt_model(arch_from_hf_config(hf_dir)).eval()
    load_dist_checkpoint(model, str(tmp_path / "mcore"), strict=True)
    ids = sample_tokens()
    assert (megatron_logits(model, ids, VOCAB) - hf_logits(hf_dir, ids)).abs().max().item() <= TOL


def test_bf16_storage_and_sharded_hf_output(tiny_models, tmp_path):
    hf_dir = tiny_models["llama"]
    hf_to_mcore(hf_dir, str(tmp_path / "mcore"), dtype="bf16", quiet=True)
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "hf_back"), max_shard_size="40KB", quiet=True)
    files = sorted(os.listdir(tmp_path / "hf_back"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 3 and "model.safetensors.index.json" in files
    from megatron_ppo.convert.hf_io import HFCheckpoint

    src, back = HFCheckpoint(hf_dir), HFCheckpoint(str(tmp_path / "hf_back"))
    assert set(src.entries) == set(back.entries)
    for name in src.entries:
        want = src.read([name])[name].to(torch.bfloat16)
        got = back.read([name])[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    with open(tmp_path / "hf_back" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    # transformers loads the sharded, bf16 directory.
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_back"))


def test_cli_both_directions(tiny_models, tmp_path, capsys):
    from megatron_ppo import cli

    hf_dir = tiny_models["qwen2_untied"]
    assert cli.main(["convert", "hf-to-mcore", "--hf", hf_dir, "--out", str(tmp_path / "m"), "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "verification summary" in out and "every source tensor consumed once" in out
    assert convert_main(["mcore-to-hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    assert "verification summary" in capsys.readouterr().out
    assert compare_hf_checkpoints(hf_dir, str(tmp_path / "h")) == []
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(tmp_path):  # readable by others as any file the user makes, not 0600 / 0700
        for name, want in [(d, 0o777) for d in dirs] + [(f, 0o666) for f in files]:
            assert os.stat(os.path.join(root, name)).st_mode & 0o777 == want & ~umask, os.path.join(root, name)
    # --hf-config points at any HF directory with the config and tokenizer.
    assert convert_main(["mcore-to-hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h2"),
                         "--hf-config", hf_dir, "--quiet"]) == 0
    assert compare_hf_checkpoints(hf_dir, str(tmp_path / "h2")) == []


# ---------------------------------------------------------------------------------------------------------------
# Multi-process (gloo): TP=2 and PP=2 models load the converted checkpoints
# ---------------------------------------------------------------------------------------------------------------
def _rank_logits(rank, world_size, tp, pp, jobs):
    """(A job of the 2-rank pool.) For each (name, hf_dir, ckpt_dir): build the model at TP x PP, load it strictly,
    return the last stage's logits."""
    from megatron.core import parallel_state as ps

    from megatron_ppo import parallel
    from megatron_ppo.models.gpt import build_gpt_model

    parallel.initialize(tp=tp, pp=pp)
    out = {}
    try:
        for name, hf_dir, ckpt_dir in jobs:
            model = build_gpt_model(arch_from_hf_config(hf_dir)).eval()
            load_dist_checkpoint(model, ckpt_dir, strict=True)
            logits = megatron_logits(model, sample_tokens(), VOCAB)
            if ps.is_pipeline_last_stage(ignore_virtual=True):
                out[name] = logits
    finally:
        parallel.destroy(destroy_process_group=False)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp_pp_layouts_logits_match_hf_and_round_trip(tp, pp, tiny_models, tmp_path, dist_pool2):
    jobs = []
    for kind in ("llama", "qwen2"):
        ckpt = str(tmp_path / f"{kind}_tp{tp}_pp{pp}")
        hf_to_mcore(tiny_models[kind], ckpt, tp=tp, pp=pp, quiet=True)
        jobs.append((kind, tiny_models[kind], ckpt))
    # A checkpoint written at the other layout loads too (TP=1 checkpoint into TP=2 / PP=2 models).
    cross = str(tmp_path / "llama_tied_tp1")
    hf_to_mcore(tiny_models["llama_tied_llama3rope"], cross, tp=1, pp=1, quiet=True)
    jobs.append(("llama_tied_llama3rope", tiny_models["llama_tied_llama3rope"], cross))

    per_rank = dist_pool2.run(_rank_logits, tp, pp, jobs)
    ids = sample_tokens()
    for name, hf_dir, ckpt in jobs:
        got = [r[name] for r in per_rank if name in r]
        assert len(got) == (2 if pp == 1 else 1)
        want = hf_logits(hf_dir, ids)
        for logits in got:
            diff = (logits - want).abs().max().item()
            assert diff <= TOL, f"{name} at TP={tp} PP={pp}: max |logit diff| {diff:.3g}"
        back = ckpt + "_hf"
        mcore_to_hf(ckpt, back, quiet=True)
        assert compare_hf_checkpoints(hf_dir, back) == []


class _CountingSafeOpen:
    """safetensors' safe_open, counting the elements every read returns (``get_tensor``, ``get_slice(...)[...]``):
    what a rank really read, whatever the importer believes it read."""

    elements = 0

    def __init__(self, path, framework="pt"):
        from safetensors import safe_open

        self._f = safe_open(path, framework=framework)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name):
        t = self._f.get_tensor(name)
        _CountingSafeOpen.elements += t.numel()
        return t

    def get_slice(self, name):
        sl = self._f.get_slice(name)

        class Slice:
            get_shape, get_dtype = sl.get_shape, sl.get_dtype

            def __getitem__(self, index):
                t = sl[index]
                _CountingSafeOpen.elements += t.numel()
                return t

        return Slice()


def _rank_slices_equal_dcp(rank, world_size, tp, pp, jobs):
    """(A job of the 2-rank pool.) For each (name, hf_dir, TP=1 conversion): the stage loaded from its slices of the
    HF files (load_hf_weights) must equal, bit for bit, the stage loaded from the TP=1 conversion with
    dist_checkpointing (the import as it was), and the rank must have read exactly the HF elements it holds (its
    parameters but the zero vocab padding). Returns the last stage's logits."""
    from unittest import mock

    from megatron.core import parallel_state as ps

    from megatron_ppo import parallel
    from megatron_ppo.convert import hf_io
    from megatron_ppo.convert.hf_import import load_hf_weights
    from megatron_ppo.models.gpt import build_gpt_model

    parallel.initialize(tp=tp, pp=pp)
    out = {}
    try:
        for name, hf_dir, ckpt_dir in jobs:
            arch = arch_from_hf_config(hf_dir)
            model = build_gpt_model(arch, "actor").eval()
            _CountingSafeOpen.elements = 0
            with mock.patch.object(hf_io, "safe_open", _CountingSafeOpen):
                load_hf_weights(model, "actor", hf_dir)
            vp, r = arch.padded_vocab_size(tp), ps.get_tensor_model_parallel_rank()
            lo, hi = r * vp // tp, (r + 1) * vp // tp
            pad_rows = max(0, hi - max(lo, arch.vocab_size))
            vocab_params = [n for n, _ in model.named_parameters() if n.startswith(("embedding.", "output_layer."))]
            held = sum(p.numel() for p in model.parameters()) - pad_rows * arch.hidden_size * len(vocab_params)
            assert _CountingSafeOpen.elements == held, (name, rank, _CountingSafeOpen.elements, held)
            ref = build_gpt_model(arch, "actor").eval()
            load_dist_checkpoint(ref, ckpt_dir, strict=True)
            got, want = dict(model.named_parameters()), dict(ref.named_parameters())
            assert got.keys() == want.keys()
            differ = [k for k in want if not torch.equal(got[k], want[k])]
            assert not differ, f"{name} TP={tp} PP={pp} rank {rank}: {differ}"
            logits = megatron_logits(model, sample_tokens(), VOCAB)
            if ps.is_pipeline_last_stage(ignore_virtual=True):
                out[name] = logits
    finally:
        parallel.destroy(destroy_process_group=False)
    return out


@pytest.mark.slow
def test_hf_import_reads_only_each_ranks_slices_and_equals_the_tp1_import(tiny_models, tmp_path, dist_pool2):
    """load_hf_weights at TP=2 (GQA: a query group per rank; MHA; tied and untied vocab rows, padding on rank 1)
    and PP=2 (a tied model's last stage reads the embedding for its output layer): each rank reads only its slices,
    its tensors equal the TP=1 conversion's bit for bit, and the logits equal transformers'. (qwen2_untied's single
    KV group cannot be split over TP=2 ranks by our model builder: row_segments' unit test covers that cut.)"""
    jobs = []
    for kind in KINDS:
        ckpt = str(tmp_path / f"{kind}_tp1")
        hf_to_mcore(tiny_models[kind], ckpt, tp=1, pp=1, quiet=True)
        jobs.append((kind, tiny_models[kind], ckpt))
    ids = sample_tokens()
    want = {kind: hf_logits(tiny_models[kind], ids) for kind in KINDS}
    for tp, pp in ((2, 1), (1, 2)):
        run = [j for j in jobs if arch_from_hf_config(j[1]).num_query_groups % tp == 0]
        per_rank = dist_pool2.run(_rank_slices_equal_dcp, tp, pp, run)
        for kind, _, _ in run:
            got = [r[kind] for r in per_rank if kind in r]
            assert len(got) == (2 if pp == 1 else 1)
            for logits in got:
                assert (logits - want[kind]).abs().max().item() <= TOL, (kind, tp, pp)


def test_piecewise_checkpoint_equals_one_shot_dist_checkpointing_save(tiny_models, tmp_path):
    """The streaming writer's merged metadata describes exactly the chunks one ``dist_checkpointing.save`` of the
    whole state dict (with megatron's access-integrity validation) writes, and both hold the same bytes."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ppo.convert.hf_io import HFCheckpoint
    from megatron_ppo.convert.mapping import conversion_pieces, mcore_key_shapes, to_mcore
    from megatron_ppo.convert.mcore_io import (DistCheckpointReader, sharded_objects, sharded_tensors,
                                               single_process_group)

    hf_dir = tiny_models["qwen2_untied"]
    arch = arch_from_hf_config(hf_dir)
    hf_to_mcore(hf_dir, str(tmp_path / "piecewise"), tp=2, quiet=True)
    ck = HFCheckpoint(hf_dir)
    state = {}
    for piece in conversion_pieces(arch, 2):
        hf = ck.read(piece.hf_names)
        for m in piece.maps:
            state.update(sharded_tensors(m, to_mcore(m, hf, arch), arch.num_layers, ""))
        if piece.layer is not None:
            state.update(sharded_objects("", piece.layer, arch.num_layers))
    (tmp_path / "one_shot").mkdir()
    with single_process_group():
        dist_checkpointing.save(state, str(tmp_path / "one_shot"), validate_access_integrity=True)

        def layout(path):
            md = FileSystemReader(path).read_metadata()
            return {k: (getattr(v, "size", None), getattr(getattr(v, "properties", None), "dtype", None),
                        sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(v, "chunks", [])))
                    for k, v in md.state_dict_metadata.items()}

        assert layout(str(tmp_path / "piecewise")) == layout(str(tmp_path / "one_shot"))
        shapes = mcore_key_shapes(arch, 2)
        a, b = DistCheckpointReader(str(tmp_path / "piecewise")), DistCheckpointReader(str(tmp_path / "one_shot"))
        for key in shapes:
            for layer in range(arch.num_layers) if key.startswith("decoder.layers.") else [None]:
                assert torch.equal(a.read([(key, layer)])[(key, layer)], b.read([(key, layer)])[(key, layer)]), key


@pytest.mark.slow  # two subprocesses that import torch, megatron and transformers
def test_verify_subcommand_and_tool_wrappers(tiny_models, tmp_path, capsys):
    import subprocess
    import sys

    hf_dir = tiny_models["llama"]
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")
    proc = subprocess.run([sys.executable, os.path.join(tools, "convert_hf_to_mcore.py"), "--hf", hf_dir,
                           "--out", str(tmp_path / "m"), "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert convert_main(["verify", "--hf", hf_dir, "--mcore", str(tmp_path / "m")]) == 0
    assert "max |logit difference| HF vs Megatron: 0 (ok" in capsys.readouterr().out
    # The same architecture with other weights fails verification.
    other = make_tiny_hf("llama", str(tmp_path / "other_hf"), seed=1)
    assert convert_main(["verify", "--hf", other, "--mcore", str(tmp_path / "m")]) == 1
    assert "FAILED" in capsys.readouterr().out
    # A checkpoint exported against the wrong config is refused, naming what is missing.
    proc = subprocess.run([sys.executable, os.path.join(tools, "convert_mcore_to_hf.py"), "--mcore",
                           str(tmp_path / "m"), "--out", str(tmp_path / "x"), "--hf-config", tiny_models["qwen2"]],
                          capture_output=True, text=True)
    assert proc.returncode == 2  # a checkpoint that cannot be converted: a data error (exit 2, issue 49)
    assert "missing tensor 'decoder.layers.self_attention.linear_qkv.bias'" in proc.stderr
    assert not os.path.exists(tmp_path / "x")
