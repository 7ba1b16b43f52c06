"""Issue 49: the commands that read a checkpoint (`eval --model`, `convert mcore-to-hf --mcore`, `convert verify
--mcore`) check it against its step's manifest first, and `convert` judges its inputs and --out before reading
anything: exit 2, one line naming the file, in well under a second, with neither torch, Ray nor Megatron imported
(so no rank or model can have started). `train`'s resume path does the same through find_resume
(tests/integration/test_checkpoint_damage.py).

The step dirs are written through the real save path (checkpoint.begin_save -> files -> finish_save, as
test_checkpoint_manifest.py), with small files in place of the model shards: every refusal here happens before a
shard is read. On the code before issue 49 each command went on to import torch and start reading (the commands'
heavy stages are replaced here by a stand-in that fails loudly, so a missing check costs no Ray start).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_ppo.trainer import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]
META_FILE = "megatron_ppo_model.json"  # models/checkpoint.py's (imported there with torch)
HEAVY = ("torch", "ray", "megatron", "transformers")
LIMIT_S = 5.0  # the checks are stats of a few files: milliseconds; an import of torch alone takes longer here
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def save_step(root: Path, step: int) -> Path:
    """A trainer checkpoint's step dir as the trainer lays it out (actor with its model meta and kept HF config,
    critic, the run's config.yaml, driver state), sealed by its manifest."""
    from megatron_ppo.config import load_config
    from megatron_ppo.config.load import to_yaml

    tmp = Path(ckpt.begin_save(str(root), step))
    for role in ("actor", "critic"):
        (tmp / role).mkdir()
        (tmp / role / "__0_0.distcp").write_bytes(os.urandom(3000))
        (tmp / role / ".metadata").write_bytes(b"m" * 40)
        (tmp / role / META_FILE).write_text(json.dumps({"role": role}))
        (tmp / f"worker_state_{role}.pt").write_bytes(os.urandom(100))
    (tmp / "actor" / "hf_config").mkdir()
    (tmp / "actor" / "hf_config" / "config.json").write_text(json.dumps(LLAMA))
    (tmp / ckpt.RUN_CONFIG).write_text(to_yaml(load_config("tiny_cpu")))
    (tmp / ckpt.DRIVER_STATE).write_text(json.dumps({"format": ckpt.FORMAT, "step": step}))
    return Path(ckpt.finish_save(str(root), str(tmp), step))


@pytest.fixture
def damaged(tmp_path) -> tuple[Path, Path]:
    """global_step_3 with its actor shard cut to half (a full disk, a node lost mid-copy); returns (step, shard)."""
    step = save_step(tmp_path / "ckpt", 3)
    shard = step / "actor" / "__0_0.distcp"
    os.truncate(shard, 1500)
    return step, shard


def run_commands(*commands: list[str], cwd: Path) -> list[dict]:
    """Each `megatron-ppo <command>` through cli.main in one fresh interpreter: exit code, seconds, stderr, and
    the heavy modules imported by then. eval's and convert's heavy stages are stand-ins that exit 1 at once."""
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys, time
        from megatron_ppo import cli
        from megatron_ppo.evaluation import cli as eval_cli

        def started(*a, **k):
            raise SystemExit("started: the model would be built now")

        eval_cli.run_eval = started
        sys.modules["megatron_ppo.convert.pipeline"] = None  # importing it (torch, Megatron) fails at once
        out = []
        for argv in {[list(c) for c in commands]!r}:
            err = io.StringIO()
            start = time.perf_counter()
            with contextlib.redirect_stderr(err):
                code = cli.main(argv)
            out.append({{"code": code, "seconds": time.perf_counter() - start, "stderr": err.getvalue(),
                         "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}})
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_refused(result: dict, *fragments: str) -> str:
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["code"] == 2, result
    assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result["heavy"] == [], result  # nothing imported that could build a model or start Ray
    assert result["seconds"] < LIMIT_S, result
    return lines[0]


def test_readers_refuse_a_damaged_checkpoint_naming_the_file_before_anything_starts(damaged, tmp_path):
    step, shard = damaged
    named = f"{shard}: truncated (expected 3000 bytes, found 1500)"
    data = str(tmp_path)  # exists: eval's --data check passes; nothing gets as far as reading it
    results = run_commands(
        ["eval", "--model", str(step / "actor"), "--data", data],
        ["eval", "--model", str(step), "--data", data],  # the step dir: its actor is what is read
        ["convert", "mcore-to-hf", "--mcore", str(step / "actor"), "--out", str(tmp_path / "hf")],
        ["convert", "verify", "--hf", str(step / "actor" / "hf_config"), "--mcore", str(step / "actor")],
        cwd=tmp_path)
    for result in results:
        line = assert_refused(result, named, "damaged checkpoint", "Nothing was run")
        assert f"megatron-ppo checkpoint verify {step}" in line
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))  # convert wrote nothing


def test_damage_outside_what_eval_reads_does_not_block_it(tmp_path, monkeypatch):
    """Only the actor's files and config.yaml are checked: a cut critic shard is the critic's problem (train's
    resume refuses the step; eval of its actor goes on), and an undamaged checkpoint passes to the model build."""
    from megatron_ppo.evaluation.cli import _parser, eval_config

    step = save_step(tmp_path / "ckpt", 3)
    os.truncate(step / "critic" / "__0_0.distcp", 10)
    assert ckpt.verify_step(str(step)).problems  # the step is damaged as a whole
    assert ckpt.verify_before_reading(str(step / "actor"), "--model") is not None
    monkeypatch.chdir(tmp_path)
    cfg, role_dir = eval_config(_parser().parse_args(["--model", str(step / "actor"), "--data", str(tmp_path)]))
    assert role_dir == str(step / "actor")
    # issue 49 item 8: the default output dir is under outputs/ (ignored by git), named by run and step
    assert cfg.trainer.log_dir == str(tmp_path / "outputs" / "eval" / f"{cfg.trainer.experiment_name}-global_step_3")
    with pytest.raises(ckpt.CheckpointError, match="critic/__0_0.distcp: truncated"):
        ckpt.verify_before_reading(str(step / "critic"), "--mcore")
    # an unreadable manifest is damage too; a dir outside a global_step_<N> has none to check
    (step / "manifest.json").write_text("{")
    with pytest.raises(ckpt.CheckpointError, match="manifest.json: not readable"):
        ckpt.verify_before_reading(str(step / "actor"), "--model")
    assert ckpt.verify_before_reading(str(tmp_path), "--model") is None


def test_eval_default_out_dir_is_under_outputs_and_help_is_whole(tmp_path, monkeypatch):
    from megatron_ppo.evaluation.cli import _parser, out_dir

    monkeypatch.chdir(tmp_path)
    hf = _parser().parse_args(["--model", "models/SmolLM2-135M-Instruct", "--data", "x"])
    assert out_dir(hf) == str(tmp_path / "outputs" / "eval" / "SmolLM2-135M-Instruct")
    given = _parser().parse_args(["--model", "m", "--data", "x", "--out", "elsewhere"])
    assert out_dir(given, "run") == str(tmp_path / "elsewhere")
    description = _parser().description
    assert description.endswith(")") and "validation" in description, description  # was cut at "...: the"


def test_convert_judges_inputs_and_out_before_reading_anything(tmp_path):
    step = save_step(tmp_path / "ckpt", 3)  # undamaged
    hf = tmp_path / "hf_in"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(LLAMA))
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    (tmp_path / "bad.gguf").write_bytes(b"junk")
    (tmp_path / "empty").mkdir()
    results = run_commands(
        ["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(used)],
        ["convert", "mcore-to-hf", "--mcore", str(step / "actor"), "--out", str(used)],
        ["convert", "hf-to-mcore", "--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o")],
        ["convert", "mcore-to-hf", "--mcore", str(tmp_path / "empty"), "--out", str(tmp_path / "o")],
        ["convert", "gguf-to-hf", "--gguf", str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "o")],
        cwd=tmp_path)
    (tmp_path / "empty" / "keep.txt").write_text("")
    assert_refused(results[0], f"--out {used}: exists and is not empty", "--overwrite")
    assert_refused(results[1], f"--out {used}: exists and is not empty")
    assert_refused(results[2], f"--hf {tmp_path / 'empty'}: no config.json")
    assert_refused(results[3], "no hf_config/config.json", "--hf-config")
    assert_refused(results[4], "not a GGUF file")
    assert (used / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists()
    # a file where --out's parent should be: named, not found after the read
    blocked = run_commands(["convert", "mcore-to-hf", "--mcore", str(step / "actor"), "--out",
                            str(tmp_path / "empty" / "keep.txt" / "x")], cwd=tmp_path)[0]
    assert_refused(blocked, "keep.txt is not a directory")
