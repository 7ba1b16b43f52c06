"""The console front door: config errors are one line and exit 2, tracebacks only with --debug and always in a log
file, --version (issue 15). Real `megatron-ppo` processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, env=None, timeout=120):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - start


def err_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_version():
    from megatron_ppo import __version__

    proc, _ = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"megatron-ppo {__version__}"


@pytest.mark.parametrize("override, names", [
    ("foo.bar=1", "foo.bar: unknown key"),
    ("actor.clip_ratio=abc", "actor.clip_ratio"),
    ("data.train_batch_size=0", "data.train_batch_size"),
])
def test_config_error_is_one_line_exit_2(override, names):
    proc, seconds = run_cli("train", override)
    lines = err_lines(proc)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) <= 3 and names in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert seconds < 10


def test_yaml_syntax_error_is_short(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_batch_size: [1\n")
    proc, _ = run_cli("train", "--config", str(bad))
    assert proc.returncode == 2
    lines = err_lines(proc)
    assert len(lines) == 1 and str(bad) in lines[0] and "line 3" in lines[0], proc.stderr
    assert "<unicode string>" not in proc.stderr and "^" not in proc.stderr, proc.stderr  # no PyYAML internals


def test_config_directory_says_directory(tmp_path):
    (tmp_path / "a.yaml").write_text("{}\n")
    proc, _ = run_cli("train", "--config", str(tmp_path))
    assert proc.returncode == 2 and "is a directory" in proc.stderr and "a.yaml" in proc.stderr, proc.stderr
    assert "does not exist" not in proc.stderr


def test_traceback_only_with_debug_and_always_in_log(tmp_path):
    env = {"TMPDIR": str(tmp_path)}
    proc, _ = run_cli("train", "foo.bar=1", env=env)
    assert "Traceback" not in proc.stderr
    logs = list(tmp_path.rglob("train-last-error.log"))
    assert logs and "Traceback" in logs[0].read_text() and "ConfigError" in logs[0].read_text()
    proc, _ = run_cli("--debug", "train", "foo.bar=1", env=env)
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr
    proc, _ = run_cli("train", "foo.bar=1", env={**env, "MEGATRON_PPO_DEBUG": "1"})
    assert "Traceback" in proc.stderr


def test_unknown_error_is_one_line_exit_1_with_log_pointer(tmp_path, monkeypatch, capsys):
    """Not a usage error: exit 1, still one line, naming where the traceback went."""
    import tempfile

    from megatron_ppo import console

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(console, "_run_log", None)  # no run started in this process (an earlier test's may linger)
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        code = console.report_error("train", exc, debug=False)
    lines = capsys.readouterr().err.splitlines()
    assert code == 1 and len(lines) == 1 and "RuntimeError: boom" in lines[0] and str(tmp_path) in lines[0]
    assert "Traceback" in (tmp_path / f"megatron-ppo-{os.getuid()}" / "train-last-error.log").read_text()


def test_unknown_command_exit_2():
    proc, _ = run_cli("trian")
    assert proc.returncode == 2 and "unknown command 'trian'" in proc.stderr


def test_quiet_silences_megatron_info_and_te_warnings():
    import logging
    import warnings

    from megatron_ppo import console

    saved = logging.getLogger("megatron.core.optimizer").level, warnings.filters[:]
    try:
        console.quiet(verbose=False)
        assert not logging.getLogger("megatron.core.optimizer").isEnabledFor(logging.INFO)
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("ignore", message=r"^(?!.*Transformer Engine).*")  # only the one under test
            console.quiet(verbose=False)
            warnings.warn("Transformer Engine is not installed. Falling back to Megatron Local")
        assert caught == []
    finally:
        logging.getLogger("megatron").setLevel(logging.NOTSET)
        logging.getLogger("megatron.core.optimizer").setLevel(saved[0])
        warnings.filters[:] = saved[1]


def test_swallowed_ctrl_c_still_exits_130(monkeypatch, tmp_path, capsys):
    """A KeyboardInterrupt lost inside a callback (as in logging's at-fork lock release during convert) used to let
    the command finish with exit 0; the recorded signal makes it 130."""
    import signal

    from megatron_ppo import cli

    module = tmp_path / "swallow_cmd.py"
    module.write_text("import os, signal\n"
                      "def main(argv):\n"
                      "    try:\n"
                      "        os.kill(os.getpid(), signal.SIGINT)\n"
                      "    except KeyboardInterrupt:\n"
                      "        pass  # what 'Exception ignored in ...' amounts to\n"
                      "    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "swallow", ("swallow_cmd", "test"))
    before = signal.getsignal(signal.SIGINT)
    assert cli.main(["swallow"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # cli.main restores the handlers it replaced


def test_convert_missing_input_names_the_flag(tmp_path):
    proc, seconds = run_cli("convert", "mcore-to-hf", "--mcore", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "--mcore" in proc.stderr and "no such directory" in proc.stderr, proc.stderr
    assert "hf_config" not in proc.stderr and len(err_lines(proc)) == 1 and seconds < 10


def test_convert_cli_constants_match_the_pipeline():
    from megatron_ppo.convert import cli, pipeline

    assert set(cli.DTYPES) == set(pipeline.DTYPES) and cli.HF_CONFIG_SUBDIR == pipeline.HF_CONFIG_SUBDIR
