"""metrics.jsonl never mixes two runs: a log dir that already holds records is refused (before anything is built)
unless trainer.overwrite=true, which starts the file afresh; run.json names the run that wrote it."""
import json
import time

import pytest
import torch.distributed as dist

from megatron_ppo.config import load_config
from megatron_ppo.errors import UsageError
from megatron_ppo.trainer.entry import main
from megatron_ppo.trainer.tracking import LogDirInUseError, Tracker, claim_log_dir


def _records(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _overrides(tmp_path, *extra):
    # the real raw GSM8K (the preflight checks it exists) and an output dir that preparing the data would create:
    # if the driver got past the log-dir check, no_data/ appears
    data = tmp_path / "no_data"
    return [f"trainer.log_dir={tmp_path / 'logs'}", f"data.preprocess.output_dir={data}",
            f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]", *extra]


def _first_run(tmp_path, *extra):
    cfg = load_config("tiny_cpu", _overrides(tmp_path, *extra))
    log_dir = claim_log_dir(cfg.trainer, "first config")
    tracker = Tracker(["jsonl"], log_dir)
    tracker.log({"x": 1.0}, step=1)
    tracker.log({"x": 2.0}, step=2)
    tracker.close()
    return cfg


def test_a_second_run_into_the_same_log_dir_is_refused_before_anything_is_built(tmp_path):
    _first_run(tmp_path)
    start = time.perf_counter()
    with pytest.raises(UsageError) as exit_info:  # exit 2 through cli.main
        main(_overrides(tmp_path))
    assert time.perf_counter() - start < 10
    message = str(exit_info.value)
    assert f"trainer.log_dir={tmp_path / 'logs'}" in message and "already holds 2 records" in message
    assert "trainer.overwrite=true" in message and "another trainer.log_dir" in message
    assert "Nothing was run" in message
    assert not dist.is_initialized()  # Megatron was never started
    assert not (tmp_path / "no_data").exists()  # nor the data prepared
    assert [r["step"] for r in _records(tmp_path / "logs")] == [1, 2]  # the first run's file is untouched


def test_the_refusal_suggests_a_new_experiment_name_when_log_dir_uses_it(tmp_path):
    log_dir = str(tmp_path / "logs" / "{experiment_name}")
    _first_run(tmp_path, f"trainer.log_dir={log_dir}")
    with pytest.raises(UsageError, match=r"choose a new trainer\.experiment_name"):
        main(_overrides(tmp_path, f"trainer.log_dir={log_dir}"))


def test_overwrite_starts_the_file_afresh_and_run_json_names_the_new_run(tmp_path):
    cfg = _first_run(tmp_path)
    first_run = json.loads((tmp_path / "logs" / "run.json").read_text())
    cfg.trainer.overwrite = True
    claim_log_dir(cfg.trainer, "second config")
    tracker = Tracker(["jsonl"], str(tmp_path / "logs"))
    tracker.log({"x": 9.0}, step=1)
    tracker.close()
    assert _records(tmp_path / "logs") == [{"step": 1, "x": 9.0}]
    run = json.loads((tmp_path / "logs" / "run.json").read_text())
    assert run["config_sha256"] != first_run["config_sha256"] and run["experiment_name"] == "tiny_cpu"


def test_the_tracker_itself_never_appends_to_another_runs_records(tmp_path):
    tracker = Tracker(["jsonl"], str(tmp_path))
    tracker.log({"x": 1.0}, step=1)
    tracker.close()
    with pytest.raises(LogDirInUseError, match=r"metrics\.jsonl already holds 1 records"):
        Tracker(["jsonl"], str(tmp_path))
    tracker = Tracker(["jsonl"], str(tmp_path), overwrite=True)
    tracker.log({"x": 5.0}, step=1)
    tracker.close()
    assert _records(tmp_path) == [{"step": 1, "x": 5.0}]
    Tracker(["console"], str(tmp_path)).close()  # no jsonl sink: nothing to mix, nothing refused
