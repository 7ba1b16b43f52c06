"""Issue 49, items 6, 7 and a slip of 8, in-process and without building a model.

6: a `prompt` column of the wrong type, a log dir that cannot be made and cluster.device=cuda on a machine without
   CUDA are refused by preflight (and so by --dry-run) before the "preflight ok" line; they used to pass it and
   surface after it, once Ray was starting.
7: a run that logged no training step (it failed or was stopped before step 1, perhaps after its validation at
   step 0) does not block the same command.
8: "1 step done", not "1 steps done".
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_ppo.config import load_config
from megatron_ppo.data.schema import GSM8K_PROMPT_SCHEMA
from megatron_ppo.trainer.entry import main
from megatron_ppo.trainer.preflight import PreflightError, check_writable, run_preflight
from megatron_ppo.trainer.tracking import LogDirInUseError, Tracker, claim_log_dir

BASE = ["data.preprocess.dataset=null", "data.val_files=[]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console,jsonl]"]


def write_prompts(path, n=16, prompt_as_text=False):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i, "answer": f"#### {i + 1}", "question": f"{i} + 1"}}
            for i in range(n)]
    schema = GSM8K_PROMPT_SCHEMA
    if prompt_as_text:  # a common hand-made file: the question as a plain string
        rows = [{**r, "prompt": r["prompt"][0]["content"]} for r in rows]
        schema = schema.set(schema.get_field_index("prompt"), pa.field("prompt", pa.string()))
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture(autouse=True)
def _no_leaked_run_log(monkeypatch):
    """main() points the root logger at <log_dir>/train.log (console.set_run_log): undone after each test."""
    from megatron_ppo import console

    root = logging.getLogger()
    before = list(root.handlers)
    monkeypatch.setattr(console, "_run_log", None)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()


def append_records(log_dir, *steps):
    """What Tracker.log writes (without its PNG curves): one {"step": N, ...} line per record."""
    with open(os.path.join(log_dir, "metrics.jsonl"), "a") as f:
        f.writelines(json.dumps({"step": step, "val/score" if step == 0 else "x": 0.25}) + "\n" for step in steps)


def overrides(tmp_path, *extra):
    return [*BASE, f"data.train_files={write_prompts(tmp_path / 't.parquet')}", "data.train_batch_size=8",
            f"trainer.log_dir={tmp_path}/logs", f"trainer.default_local_dir={tmp_path}/ckpt", *extra]


# --- item 6: the checks the README calls preflight, before "preflight ok" -------------------------------------------

def _broken_symlink(tmp_path):
    os.symlink(tmp_path / "unmounted_scratch", tmp_path / "outputs")  # e.g. a scratch disk that is not mounted
    return f"trainer.log_dir={tmp_path}/outputs/logs"


CASES = {
    "prompt_type": (lambda p: f"data.train_files={write_prompts(p / 'text.parquet', prompt_as_text=True)}",
                    ["data.train_files", "text.parquet", "column 'prompt' has type string"]),
    "log_dir": (_broken_symlink, ["trainer.log_dir", "outputs", "symlink", "unmounted_scratch"]),
    "device": (lambda p: "cluster.device=cuda", ["cluster.device=cuda", "torch.cuda.is_available() is false"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_refuses_before_preflight_ok(tmp_path, monkeypatch, caplog, case):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine, as a CPU-only one
    bad, names = CASES[case]
    with caplog.at_level(logging.INFO), pytest.raises(PreflightError) as err:  # exit 2 through cli.main
        main(["--dry-run", *overrides(tmp_path, bad(tmp_path))])
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in names), message
    assert "preflight ok" not in caplog.text
    assert not (tmp_path / "logs").exists() and not (tmp_path / "unmounted_scratch").exists()


def test_dry_run_says_preflight_ok_once_all_checks_passed(tmp_path, caplog, capsys):
    with caplog.at_level(logging.INFO):
        assert main(["--dry-run", *overrides(tmp_path)]) == 0
    assert caplog.text.count("preflight ok (16 train rows") == 1
    assert "device" in capsys.readouterr().out.splitlines()[0]
    assert not (tmp_path / "logs").exists()  # the writability trial left nothing


def test_prompt_column_type_is_checked_for_val_files_and_names_the_key(tmp_path):
    bad = write_prompts(tmp_path / "v.parquet", prompt_as_text=True)
    cfg = load_config("tiny_cpu", overrides(tmp_path, f"data.val_files=[{bad}]"))
    with pytest.raises(PreflightError, match=r"^data\.val_files: .*v\.parquet: column 'prompt' has type string"):
        run_preflight(cfg, machine=False)


def test_check_writable_tries_what_the_run_will_do_and_leaves_nothing(tmp_path):
    check_writable("trainer.log_dir", str(tmp_path / "a" / "b" / "c"))
    assert os.listdir(tmp_path) == []  # the directories of the trial are removed again
    with pytest.raises(PreflightError, match=r"^trainer\.log_dir=.*: File name too long; choose another"):
        check_writable("trainer.log_dir", str(tmp_path / ("x" * 300) / "logs"))  # was a raw OSError
    (tmp_path / "logs" / "metrics.jsonl").mkdir(parents=True)  # what the run would open for writing
    with pytest.raises(PreflightError, match=r"metrics\.jsonl is a directory; remove it"):
        check_writable("trainer.log_dir", str(tmp_path / "logs"), ("metrics.jsonl", "run.json"))


# --- item 7: a run that logged no training step does not block the same command ------------------------------------

class Boom(RuntimeError):
    pass


def _failing_start(log_validation: bool):
    """build_components failing before step 1: after validating at step 0 (val_before_train) or at once."""
    def build(cfg, resuming=False):
        if log_validation:
            append_records(cfg.trainer.expand(cfg.trainer.log_dir), 0)
        raise Boom("failed before step 1")
    return build


@pytest.mark.parametrize("log_validation", [False, True], ids=["nothing_logged", "validated_at_step_0"])
def test_a_failed_start_does_not_block_the_same_command(tmp_path, monkeypatch, log_validation):
    import megatron_ppo.trainer.components as components

    monkeypatch.setattr(components, "build_components", _failing_start(log_validation))
    argv = overrides(tmp_path, "cluster.launcher=local", "cluster.actor.tensor_model_parallel_size=1",
                     "cluster.ref.tensor_model_parallel_size=1")
    for _ in range(2):  # the rerun meets the same error, not "already holds records of an earlier run"
        with pytest.raises(Boom):
            main(argv)
    logs = tmp_path / "logs"
    assert (logs / "run.json").is_file() and (logs / "train.log").is_file()
    assert len((logs / "metrics.jsonl").read_text().splitlines()) == int(log_validation)


def test_a_run_with_training_steps_still_blocks_and_says_how_to_go_on(tmp_path):
    cfg = load_config("tiny_cpu", overrides(tmp_path))
    append_records(claim_log_dir(cfg.trainer, "first"), 0, 1)
    with pytest.raises(LogDirInUseError, match=r"2 records of an earlier run \(up to step 1;.*trainer\.overwrite=true"):
        claim_log_dir(cfg.trainer, "second")


def test_only_a_validation_record_is_started_afresh(tmp_path):
    cfg = load_config("tiny_cpu", overrides(tmp_path))
    log_dir = claim_log_dir(cfg.trainer, "first")
    append_records(log_dir, 0)
    claim_log_dir(cfg.trainer, "second")
    assert (tmp_path / "logs" / "metrics.jsonl").read_text() == ""
    Tracker(["jsonl"], log_dir).close()  # nor does the tracker itself refuse it
    run = json.loads((tmp_path / "logs" / "run.json").read_text())
    assert run["config_sha256"] == hashlib.sha256(b"second").hexdigest()


# --- item 8: "1 step done" ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps,text", [(1, "1 step done;"), (2, "2 steps done;")])
def test_the_end_line_pluralises(tmp_path, monkeypatch, capsys, steps, text):
    import megatron_ppo.trainer.components as components
    import megatron_ppo.trainer.ppo as ppo

    parts = SimpleNamespace(total_steps=steps, tracker=SimpleNamespace(), close=lambda: None)
    monkeypatch.setattr(components, "build_components", lambda cfg, resuming=False: parts)

    class Trainer:
        def __init__(self, cfg, parts):
            self.step = 0

        def fit(self, total):
            self.step = total
            return [{"reward/score/mean": 0.5}] * total

    monkeypatch.setattr(ppo, "PPOTrainer", Trainer)
    assert main(overrides(tmp_path, "cluster.launcher=local", "cluster.actor.tensor_model_parallel_size=1",
                          "cluster.ref.tensor_model_parallel_size=1")) == 0
    assert f"megatron-ppo train: {text} last reward/score/mean=0.5000" in capsys.readouterr().out
