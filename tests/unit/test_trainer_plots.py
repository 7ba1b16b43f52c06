"""Run directory: PNG curves from metrics.jsonl (trainer/plots.py, `megatron-ppo plot`), the tracker redrawing them
at validation and close, the run record (config.yaml, versions.json, layout.json) and GPU metrics with NVML absent."""
from __future__ import annotations

import json
import sys

import pytest

from megatron_ppo.trainer import plots
from megatron_ppo.trainer.tracking import Tracker

PNG = b"\x89PNG\r\n\x1a\n"


def _records(n=6, with_val=True):
    out = []
    for step in range(1, n + 1):
        r = {"step": step, "reward/score/mean": 0.1 * step, "actor/pg_loss": -0.01 * step, "actor/ppo_kl": 1e-3,
             "actor/entropy": 5.0 - step / 10, "actor/grad_norm": 1.0, "response_length/mean": 8.0,
             "timing/step": 2.0, "critic/vf_loss": "nan"}  # a non-finite value is stored as a string
        if with_val and step % 3 == 0:
            r["val/test_score/openai/gsm8k"] = 0.05 * step
        out.append(r)
    return out


def test_plot_run_writes_one_png_per_logged_panel(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    written = plots.plot_run(tmp_path)
    names = sorted(p.name for p in written[1:])
    # critic/vf_loss is only NaN, but actor/pg_loss is there: the loss panel stays; no KL-in-reward, no rollout_corr
    assert names == sorted(f"{n}.png" for n in ("reward", "val_score", "kl", "entropy", "loss", "grad_norm",
                                                 "response_length", "step_time"))
    assert written[0] == tmp_path / "curves.png"
    assert all(p.read_bytes()[:8] == PNG for p in written)
    s = plots.series(plots.read_metrics(tmp_path / "metrics.jsonl"), ("val/",))
    assert s == {"val/test_score/openai/gsm8k": ([3, 6], [pytest.approx(0.15), pytest.approx(0.3)])}


def test_plot_command(tmp_path, capsys):
    from megatron_ppo.cli import main

    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl:2: not a JSON record" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert main(["plot", str(tmp_path)]) == 0
    assert f"curves: {tmp_path / 'curves.png'}" in capsys.readouterr().out


def test_tracker_redraws_at_validation_and_close_without_nvml(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py absent: the import fails
    tracker = Tracker(["jsonl"], str(tmp_path))
    logged = tracker.log({"reward/score/mean": 0.1}, step=1)
    assert not (tmp_path / "curves.png").exists()  # no validation yet
    assert not any(k.startswith("perf/gpu") for k in logged)
    tracker.log({"reward/score/mean": 0.2, "val/test_score/x": 0.5}, step=2)
    first = (tmp_path / "curves.png").stat().st_mtime_ns
    assert (tmp_path / "curves" / "val_score.png").is_file()
    tracker.log({"reward/score/mean": 0.3}, step=3)
    tracker.close()
    assert (tmp_path / "curves.png").stat().st_mtime_ns >= first
    assert f"curves: {tmp_path / 'curves.png'}" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_gpu_monitor_is_empty_without_nvml(monkeypatch):
    from megatron_ppo.trainer.run_record import GpuMonitor

    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert GpuMonitor().sample() == {}


def test_run_record(tmp_path):
    from megatron_ppo.config import load_config
    from megatron_ppo.distributed.layout import RankLayout
    from megatron_ppo.trainer.run_record import write_run_record

    cfg = load_config("tiny_cpu", ["trainer.seed=7"])
    write_run_record(tmp_path, cfg, {"actor": RankLayout(2, 1, 1), "critic": RankLayout(1, 1, 2)},
                     {"actor": [1, 1], "critic": [1, 1]})
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg  # the resolved config reruns as is
    versions = json.loads((tmp_path / "versions.json").read_text())
    assert versions["torch"] and versions["megatron-core"] and versions["python"]
    layout = json.loads((tmp_path / "layout.json").read_text())
    assert layout["roles"] == {"actor": {"tp": 2, "pp": 1, "dp": 1, "ranks": 2, "torch_threads": [1, 1]},
                               "critic": {"tp": 1, "pp": 1, "dp": 2, "ranks": 2, "torch_threads": [1, 1]}}
    assert layout["num_cpus_per_rank"] == "auto"
    assert layout["launcher"] == "ray"
