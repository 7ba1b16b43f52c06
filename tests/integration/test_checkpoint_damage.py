"""Issue 29 on checkpoints written by the real trainer (CPU, launcher=local, `megatron-ppo train` in-process): a
2-step run saves global_step_1 and global_step_2, then one shard of the latest is cut to half its size, as a full
disk or a node lost mid-copy leaves it.

- resume_mode=auto falls back to global_step_1 with a warning naming the file and its expected and found sizes,
  and the run then logs exactly (==) what a resume_path run from global_step_1 logs;
- resume_mode=resume_path on global_step_2 exits 2 with one line naming the file, before any model code is
  imported or the log dir is claimed (a check moved after the model build would fail both);
- `megatron-ppo checkpoint verify` names the same file.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_resume import _comparable, _overrides, data_dir  # noqa: E402,F401  (helpers and fixture reused)

REPO = Path(__file__).resolve().parents[2]
REFUSAL_LIMIT_S = 60  # the refusal itself takes well under a second; a model build and 3 steps take minutes here


def _train(data_dir: Path, tmp: Path, **extra) -> list[dict]:
    """`megatron-ppo train` in this process (entry.main: preflight, find_resume, log dir, build, fit)."""
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer import entry

    try:
        assert entry.main(_overrides(data_dir, tmp, **{"trainer.save_freq": 1, **extra})) == 0
    finally:
        disable_cpu_platform()
    return [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def saved(data_dir, tmp_path_factory):
    """A 2-step run's checkpoints (global_step_1, global_step_2; sha256 digests recorded), pristine: tests copy
    them."""
    tmp = tmp_path_factory.mktemp("damage_run")
    records = _train(data_dir, tmp, **{"trainer.total_training_steps": 2, "trainer.verify_checkpoint": "full"})
    assert [r["step"] for r in records] == [1, 2]
    assert sorted(p.name for p in (tmp / "ckpt").glob("global_step_*")) == ["global_step_1", "global_step_2"]
    return tmp


def _damaged_copy(saved: Path, tmp: Path) -> tuple[Path, str, int]:
    """A copy of the run (checkpoints and logs) with the largest actor shard of global_step_2 cut to half."""
    shutil.copytree(saved, tmp, dirs_exist_ok=True)
    actor = tmp / "ckpt" / "global_step_2" / "actor"
    shard = max(actor.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    return shard, f"global_step_2/actor/{shard.name}", size


@pytest.mark.slow  # three tiny runs in-process: 30 s on 2 idle cores, 2 min on loaded ones
def test_auto_falls_back_to_the_last_good_step_and_continues_like_a_resume_from_it(data_dir, saved, tmp_path,
                                                                                     caplog):
    shard, name, size = _damaged_copy(saved, tmp_path / "run")
    caplog.set_level(logging.WARNING, logger="megatron_ppo.trainer.checkpoint")
    # the same command again (resume_mode=auto, the default), one step further
    records = _train(data_dir, tmp_path / "run", **{"trainer.total_training_steps": 3})
    warnings = [r.getMessage() for r in caplog.records if r.name == "megatron_ppo.trainer.checkpoint"]
    assert any(f"{name}: truncated (expected {size} bytes, found {size // 2})" in w and "skipped" in w
               for w in warnings), warnings
    assert any("resuming from " + str(tmp_path / "run" / "ckpt" / "global_step_1") in w for w in warnings), warnings
    assert [r["step"] for r in records] == [1, 2, 3]  # the file cut back to step 1, steps 2-3 appended once

    reference = _train(data_dir, tmp_path / "ref", **{
        "trainer.total_training_steps": 3, "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": str(saved / "ckpt" / "global_step_1")})
    assert [r["step"] for r in reference] == [2, 3]
    for got, want in zip(records[1:], reference):
        assert _comparable(got) == _comparable(want)
    # the re-saved step 2 replaced the damaged one: the checkpoints verify again
    from megatron_ppo.trainer import checkpoint as ckpt

    assert not ckpt.verify_step(str(tmp_path / "run" / "ckpt" / "global_step_2")).problems


@pytest.mark.slow  # the fixture's 2-step run
def test_resume_path_to_the_damaged_step_exits_2_before_anything_starts(data_dir, saved, tmp_path):
    shard, name, size = _damaged_copy(saved, tmp_path / "run")
    logs = tmp_path / "fresh_logs"
    overrides = [*_overrides(data_dir, tmp_path / "run"), f"trainer.log_dir={logs}", "trainer.resume_mode=resume_path",
                 f"trainer.resume_from_path={shard.parents[1]}"]
    code = textwrap.dedent(f"""
        import json, sys, time
        from megatron_ppo import cli
        start = time.perf_counter()
        code = cli.main(["train", *{overrides!r}])
        heavy = sorted(m for m in ("megatron", "ray") if m in sys.modules)
        print(json.dumps({{"code": code, "seconds": time.perf_counter() - start, "heavy": heavy}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{shard}: truncated (expected {size} bytes, found {size // 2})" in lines[0], lines[0]
    assert "Nothing was run" in lines[0]
    assert result["heavy"] == [], result  # no model code imported: no rank was built
    assert not logs.exists()  # the log dir (claimed right after the check, before any build) untouched
    assert result["seconds"] < REFUSAL_LIMIT_S, result


@pytest.mark.slow  # the fixture's 2-step run
def test_checkpoint_verify_names_the_damaged_file(saved, tmp_path):
    shard, name, size = _damaged_copy(saved, tmp_path / "run")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "checkpoint", "verify",
                           str(tmp_path / "run" / "ckpt")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"{shard}: truncated (expected {size} bytes, found {size // 2})" in proc.stdout, proc.stdout
    assert "2 checkpoint(s): 1 ok, 1 damaged, 0 without a manifest" in proc.stdout, proc.stdout
    assert time.perf_counter() - start < REFUSAL_LIMIT_S


def _largest_shard(step: Path) -> Path:
    return max((step / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _garble_keeping_size(path: Path) -> None:
    text = path.read_text()
    path.write_text("X" + text[1:])


DAMAGES = {  # name: (damage global_step_2, verify mode, what the check names or None, the step auto resumes)
    "deleted shard": (lambda d: _largest_shard(d).unlink(), "size", "missing", 1),
    "flipped byte, full": (lambda d: _flip_a_byte(_largest_shard(d)), "full", "altered", 1),
    "flipped byte, size": (lambda d: _flip_a_byte(_largest_shard(d)), "size", None, 2),  # sizes cannot see it
    "damaged driver state": (lambda d: _garble_keeping_size(d / "driver_state.json"), "size",
                             "driver_state.json: not readable", 1),  # the size check alone would pass it
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), "size", None, 2),  # an older save: as before
}


@pytest.mark.slow  # the fixture's 2-step run; the checks themselves take milliseconds
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_each_damage_to_a_real_checkpoint_is_named_and_auto_takes_the_last_good_step(data_dir, saved, tmp_path,
                                                                                      damage):
    from megatron_ppo.config import load_config
    from megatron_ppo.trainer import checkpoint as ckpt

    apply, mode, named, resumes = DAMAGES[damage]
    shutil.copytree(saved, tmp_path / "run")
    step2 = tmp_path / "run" / "ckpt" / "global_step_2"
    apply(step2)
    problems = [str(p) for p in ckpt.verify_step(str(step2), full=mode == "full").problems]
    if named is None:
        assert problems == []
    else:
        assert len(problems) == 1 and named in problems[0], problems
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path / "run", **{"trainer.verify_checkpoint": mode}))
    assert ckpt.find_resume(cfg.trainer) == str(tmp_path / "run" / "ckpt" / f"global_step_{resumes}")
