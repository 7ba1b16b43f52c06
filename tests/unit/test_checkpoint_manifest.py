"""Checkpoint manifests (issue 29): a step dir is sealed by manifest.json (every file's size, sha256 with
trainer.verify_checkpoint=full); damage after the save is named before a resume starts anything.

The step dirs here are written through the real save path (checkpoint.begin_save -> files -> finish_save) with
small real files in place of the model shards; tests/integration/test_checkpoint_damage.py does the same on
checkpoints written by the trainer.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.trainer import checkpoint as ckpt
from megatron_ppo.trainer import checkpoint_manifest as M

REPO = Path(__file__).resolve().parents[2]
SHARD = "actor/__0_1.distcp"


def save_step(root: Path, step: int, digests: bool = False) -> Path:
    """A step dir as save_checkpoint lays it out (shards, hidden metadata, worker and driver state), sealed."""
    tmp = Path(ckpt.begin_save(str(root), step))
    for role, size in (("actor", 3000), ("critic", 2000)):
        (tmp / role).mkdir()
        (tmp / role / "__0_0.distcp").write_bytes(os.urandom(size))
        (tmp / role / "__0_1.distcp").write_bytes(os.urandom(size + 1))
        (tmp / role / ".metadata").write_bytes(b"m" * 40)
        (tmp / f"worker_state_{role}.pt").write_bytes(os.urandom(100))
    (tmp / ckpt.RUN_CONFIG).write_text("trainer: {}\n")
    (tmp / ckpt.DRIVER_STATE).write_text(json.dumps({"format": ckpt.FORMAT, "step": step, "sampler": {}}))
    return Path(ckpt.finish_save(str(root), str(tmp), step, digests=digests))


def trainer_cfg(root: Path, *extra: str):
    return load_config("tiny_cpu", [f"trainer.default_local_dir={root}", *extra]).trainer


def resume_path_cfg(path: Path, *extra: str):
    return load_config("tiny_cpu", ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={path}",
                                    *extra]).trainer


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_but_itself_with_sizes_and_optional_digests(tmp_path):
    sized = save_step(tmp_path / "a", 1)
    manifest = json.loads((sized / M.MANIFEST).read_text())
    on_disk = sorted(str(p.relative_to(sized)) for p in sized.rglob("*") if p.is_file() and p.name != M.MANIFEST)
    assert sorted(manifest["files"]) == on_disk and "actor/.metadata" in on_disk and ckpt.DRIVER_STATE in on_disk
    assert all(e["size"] == (sized / p).stat().st_size for p, e in manifest["files"].items())
    assert manifest["digest"] is None and not any("sha256" in e for e in manifest["files"].values())
    assert manifest["format"] == M.FORMAT and manifest["pruned"] == []
    assert not list(sized.glob("*.tmp"))  # written atomically: no tmp file left

    digested = save_step(tmp_path / "b", 1, digests=True)
    files = M.read(str(digested))["files"]
    assert all(e["sha256"] == hashlib.sha256((digested / p).read_bytes()).hexdigest() for p, e in files.items())
    assert not ckpt.verify_step(str(digested), full=True).problems


@pytest.mark.parametrize("damage, what, expected, found", [
    ("truncate", "truncated", "3001 bytes", "1500"),
    ("grow", "larger than saved", "3001 bytes", "3005"),
    ("delete", "missing", "3001 bytes", "no file"),
])
def test_size_damage_is_named_with_expected_and_found(tmp_path, damage, what, expected, found):
    step = save_step(tmp_path, 2)
    shard = step / SHARD
    if damage == "truncate":
        os.truncate(shard, 1500)
    elif damage == "grow":
        with open(shard, "ab") as f:
            f.write(b"xxxx")
    else:
        shard.unlink()
    check = ckpt.verify_step(str(step))
    assert [str(p) for p in check.problems] == [f"{SHARD}: {what} (expected {expected}, found {found})"]
    assert f"{step}/{SHARD}: {what} (expected {expected}, found {found})" in check.describe()


def test_flipped_byte_is_found_only_in_full_mode_and_only_with_recorded_digests(tmp_path):
    digested = save_step(tmp_path / "a", 1, digests=True)
    flip_byte(digested / SHARD)
    assert not ckpt.verify_step(str(digested)).problems  # size mode: same size, not read
    problems = ckpt.verify_step(str(digested), full=True).problems
    assert len(problems) == 1 and problems[0].path == SHARD and problems[0].what == "altered"
    want = M.read(str(digested))["files"][SHARD]["sha256"]
    got = hashlib.sha256((digested / SHARD).read_bytes()).hexdigest()
    assert str(problems[0]) == f"{SHARD}: altered (expected sha256 {want[:16]}..., found {got[:16]}...)"

    sized = save_step(tmp_path / "b", 1)  # saved with verify_checkpoint=size: no digest to compare with
    flip_byte(sized / SHARD)
    check = ckpt.verify_step(str(sized), full=True)
    assert not check.problems and any("no digests recorded" in n for n in check.notes)


def test_damaged_driver_state_or_manifest_is_named(tmp_path):
    step = save_step(tmp_path, 1)
    state = step / ckpt.DRIVER_STATE
    state.write_bytes(b"\0" * state.stat().st_size)  # same size: only reading it tells
    (problem,) = ckpt.verify_step(str(step)).problems
    assert problem.path == ckpt.DRIVER_STATE and problem.what == "not readable" and "JSONDecodeError" in problem.found

    state.write_text(json.dumps({"format": 99}).ljust(len(state.read_text())))
    (problem,) = ckpt.verify_step(str(step)).problems
    assert str(problem) == f"{ckpt.DRIVER_STATE}: another format (expected format 1, found format 99)"

    other = save_step(tmp_path / "b", 1)
    (other / M.MANIFEST).write_text("{not json")
    (problem,) = ckpt.verify_step(str(other)).problems
    assert problem.path == M.MANIFEST and problem.what == "not readable"


def test_auto_falls_back_to_the_newest_step_that_verifies_and_names_what_it_skipped(tmp_path, caplog):
    for step in (1, 2, 3):
        save_step(tmp_path, step)
    os.truncate(tmp_path / "global_step_3" / SHARD, 10)
    (tmp_path / "global_step_2" / ckpt.DRIVER_STATE).unlink()  # no longer "complete": named, not passed over
    caplog.set_level(logging.INFO, logger=ckpt.__name__)
    assert ckpt.find_resume(trainer_cfg(tmp_path)) == str(tmp_path / "global_step_1")
    text = caplog.text
    assert f"global_step_3/{SHARD}: truncated (expected 3001 bytes, found 10)" in text
    assert f"global_step_2/{ckpt.DRIVER_STATE}: missing (expected" in text
    assert "resuming from " + str(tmp_path / "global_step_1") in text and "skipped global_step_3, global_step_2" in text

    # disable: today's behaviour, the newest complete step, unchecked
    unchecked = trainer_cfg(tmp_path, "trainer.verify_checkpoint=disable")
    assert ckpt.find_resume(unchecked) == str(tmp_path / "global_step_3")


def test_auto_refuses_when_no_step_verifies_never_starting_afresh(tmp_path):
    for step in (1, 2):
        save_step(tmp_path, step)
        (tmp_path / f"global_step_{step}" / SHARD).unlink()
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.find_resume(trainer_cfg(tmp_path))
    message = str(info.value)
    assert "no checkpoint under" in message and "trainer.resume_mode=disable" in message
    for step in (1, 2):
        assert f"global_step_{step}/{SHARD}: missing (expected 3001 bytes, found no file)" in message


def test_resume_path_refuses_a_damaged_step_naming_the_file(tmp_path):
    step = save_step(tmp_path, 2)
    assert ckpt.find_resume(resume_path_cfg(step)) == str(step)
    os.truncate(step / SHARD, 1500)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.find_resume(resume_path_cfg(step))
    assert f"{step}/{SHARD}: truncated (expected 3001 bytes, found 1500)" in str(info.value)
    assert isinstance(info.value, ckpt.UsageError)  # the CLI's exit 2
    assert ckpt.find_resume(resume_path_cfg(step, "trainer.verify_checkpoint=disable")) == str(step)


def test_a_step_without_manifest_resumes_as_before_with_a_note(tmp_path, caplog):
    step = save_step(tmp_path, 1)
    (step / M.MANIFEST).unlink()
    os.truncate(step / SHARD, 10)  # not detectable without a manifest: resumed as before manifests existed
    caplog.set_level(logging.INFO, logger=ckpt.__name__)
    assert ckpt.find_resume(trainer_cfg(tmp_path)) == str(step)
    assert ckpt.find_resume(resume_path_cfg(step)) == str(step)
    notes = [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()]
    assert len(notes) == 2 and all("no manifest.json" in n for n in notes)


def test_pruned_role_dirs_are_not_missing_files(tmp_path):
    """prune() drops a role's files from the step's manifest before deleting them: the step still verifies (and a
    crash in the middle of the deletion leaves unlisted files, not missing ones); auto never falls back to it (that
    run cannot resume without the role)."""
    for step in (1, 2, 3):
        save_step(tmp_path, step)
    gone = ckpt.prune(str(tmp_path), {"actor": 2, "critic": 1}, current=3)
    assert str(tmp_path / "global_step_2" / "critic") in gone and ckpt.complete_steps(str(tmp_path)) == [2, 3]
    check = ckpt.verify_step(str(tmp_path / "global_step_2"))
    assert not check.problems and check.manifest["pruned"] == ["critic"]
    assert "critic/ deleted by trainer.max_critic_ckpt_to_keep" in check.notes
    assert not any(p.startswith("critic/") for p in check.manifest["files"])

    os.truncate(tmp_path / "global_step_3" / SHARD, 10)
    with pytest.raises(ckpt.CheckpointError, match="global_step_2: .*critic/ deleted by "
                                                   "trainer.max_critic_ckpt_to_keep"):
        ckpt.find_resume(trainer_cfg(tmp_path))

    # a crash between the manifest rewrite and the deletion
    (tmp_path / "global_step_2" / "actor" / "__0_0.distcp").unlink()
    M.mark_pruned(str(tmp_path / "global_step_2"), "actor")
    assert not ckpt.verify_step(str(tmp_path / "global_step_2")).problems


def test_checkpoint_verify_command_prints_a_table_and_exits_1_on_damage(tmp_path, capsys):
    from megatron_ppo import cli

    save_step(tmp_path, 1, digests=True)
    save_step(tmp_path, 2, digests=True)
    old = save_step(tmp_path, 3)
    (old / M.MANIFEST).unlink()
    assert cli.main(["checkpoint", "verify", str(tmp_path), "--full"]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoint(s): 2 ok, 0 damaged, 1 without a manifest" in out and "no manifest" in out
    assert "digests of the 2 of 3 steps that recorded them" in out

    flip_byte(tmp_path / "global_step_2" / SHARD)
    assert cli.main(["checkpoint", "verify", str(tmp_path)]) == 0  # sizes only: a flipped byte is not seen
    capsys.readouterr()
    assert cli.main(["checkpoint", "verify", str(tmp_path), "--full"]) == 1
    out = capsys.readouterr().out
    assert "damaged" in out and f"{tmp_path / 'global_step_2'}/{SHARD}: altered (expected sha256" in out
    assert "3 checkpoint(s): 1 ok, 1 damaged, 1 without a manifest" in out

    assert cli.main(["checkpoint", "verify", str(tmp_path / "global_step_1"), "--full"]) == 0  # one step dir
    assert "1 checkpoint(s): 1 ok" in (out := capsys.readouterr().out) and "sizes and digests checked" in out
    save_step(tmp_path / "sizes_only", 4)  # saved without digests: --full must not claim it checked any
    assert cli.main(["checkpoint", "verify", str(tmp_path / "sizes_only"), "--full"]) == 0
    assert "no digests to check (none recorded" in (out := capsys.readouterr().out) and "digests checked" not in out
    assert cli.main(["checkpoint", "verify", str(tmp_path / "global_step_1" / "actor")]) == 2  # no checkpoint
    assert "no global_step_<N> directory" in capsys.readouterr().err


def test_resume_preflight_imports_no_torch(tmp_path):
    """The check runs before Ray or any model: it must not pay for torch either (checkpoint.py imports it lazily)."""
    save_step(tmp_path, 1)
    code = (f"import sys; from megatron_ppo.config import load_config; "
            f"from megatron_ppo.trainer.checkpoint import find_resume; "
            f"assert find_resume(load_config('tiny_cpu', ['trainer.default_local_dir={tmp_path}']).trainer); "
            f"heavy = [m for m in ('torch', 'megatron', 'ray') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
