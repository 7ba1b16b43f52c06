"""Exit code 2 is chosen by type (issue 24): every input error subclasses megatron_ppo.errors.UsageError, and neither
console.report_error nor cli.main matches class names or message text."""
from __future__ import annotations

import importlib
import tempfile

import pytest

from megatron_ppo import cli, console
from megatron_ppo.errors import UsageError

# every error the user fixes by changing a key, a file or an argument: (module, class)
INPUT_ERRORS = [
    ("megatron_ppo.config.io", "ConfigError"),
    ("megatron_ppo.data.schema", "SchemaError"),
    ("megatron_ppo.data.prompt_dataset", "PromptTooLongError"),
    ("megatron_ppo.rewards.batch", "RewardError"),
    ("megatron_ppo.rewards.registry", "UnknownDataSourceError"),
    ("megatron_ppo.trainer.preflight", "PreflightError"),
    ("megatron_ppo.distributed.layout", "LayoutError"),
    ("megatron_ppo.convert.mapping", "ConversionError"),
    ("megatron_ppo.trainer.tracking", "LogDirInUseError"),
    ("megatron_ppo.data.manifest", "ManifestMismatchError"),
    ("megatron_ppo.trainer.checkpoint", "CheckpointError"),
    ("megatron_ppo.data.trajectory", "TrajectoryError"),
    ("megatron_ppo.compat.mcore", "McoreVersionError"),
    ("megatron_ppo.data.gsm8k", "MalformedLineError"),
]


def _instance(module: str, name: str) -> BaseException:
    cls = getattr(importlib.import_module(module), name)
    return cls(["bad.key: wrong"]) if name == "ConfigError" else cls("bad.key: wrong")


@pytest.fixture
def no_run_log(tmp_path, monkeypatch):
    """report_error's traceback goes to a fallback log under tmp_path, not the user's temp dir."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(console, "_run_log", None)


def test_console_reexports_the_one_usage_error():
    assert console.UsageError is UsageError and issubclass(UsageError, ValueError) and UsageError.exit_code == 2


@pytest.mark.parametrize("module, name", INPUT_ERRORS, ids=[n for _, n in INPUT_ERRORS])
def test_every_input_error_is_a_usage_error_and_exits_2(module, name, no_run_log, capsys):
    exc = _instance(module, name)
    assert isinstance(exc, UsageError) and isinstance(exc, ValueError)
    assert console.is_usage_error(exc)
    assert console.report_error("train", exc, debug=False) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-ppo train: error: ") and "bad.key" in lines[0], lines
    assert "traceback in" not in lines[0]  # a usage error is the user's to fix: no pointer to a traceback


def test_the_bases_callers_catch_are_kept():
    from megatron_ppo.rewards.registry import UnknownDataSourceError
    from megatron_ppo.trainer.tracking import LogDirInUseError

    assert issubclass(LogDirInUseError, FileExistsError) and issubclass(UnknownDataSourceError, LookupError)


def test_a_class_name_alone_no_longer_means_exit_2(no_run_log, capsys):
    """The old rule matched names ("LayoutError", ...): a RuntimeError of that name is not a usage error."""
    impostor = type("LayoutError", (RuntimeError,), {})("boom")
    assert not console.is_usage_error(impostor)
    assert console.report_error("train", impostor, debug=False) == 1
    assert console.report_error("train", RuntimeError("boom"), debug=False) == 1
    assert "RuntimeError: boom" in capsys.readouterr().err


@pytest.mark.parametrize("exc", [FileNotFoundError("nope.yaml"), IsADirectoryError("d"), PermissionError("p")])
def test_a_path_the_user_named_that_is_unusable_is_exit_2(exc, no_run_log, capsys):
    assert console.report_error("train", exc, debug=False) == 2


@pytest.fixture
def fake_commands(tmp_path, monkeypatch):
    module = tmp_path / "usage_error_cmds.py"
    module.write_text("from megatron_ppo.errors import UsageError\n"
                      "def stops(argv):\n"
                      "    raise SystemExit('megatron-ppo fake: stopped: Nothing was run.')\n"
                      "def refuses(argv):\n"
                      "    raise UsageError('bad.key=1 is wrong. Nothing was run.')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("stops", "refuses"):
        shim = tmp_path / f"usage_error_{name}.py"
        shim.write_text(f"from usage_error_cmds import {name} as main\n")
        monkeypatch.setitem(cli.COMMANDS, name, (f"usage_error_{name}", "test"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(console, "_run_log", None)


def test_systemexit_text_is_exit_1_whatever_it_says(fake_commands, capsys):
    """No text matching: "Nothing was run" in a SystemExit message used to mean exit 2."""
    assert cli.main(["stops"]) == 1
    assert capsys.readouterr().err.strip() == "megatron-ppo fake: stopped: Nothing was run."


def test_a_command_raising_usage_error_exits_2_with_one_line(fake_commands, capsys):
    assert cli.main(["refuses"]) == 2
    assert capsys.readouterr().err.splitlines() == ["megatron-ppo refuses: error: bad.key=1 is wrong. Nothing was run."]


def test_train_refusal_is_exit_2_and_one_line_without_a_doubled_prefix(no_run_log, capsys):
    """A setting the driver would ignore is refused by `megatron-ppo train` before anything runs."""
    assert cli.main(["train", "trainer.log_val_generations=4"]) == 2
    lines = capsys.readouterr().err.splitlines()
    refusal = [line for line in lines if "Nothing was run" in line]
    assert refusal == [f"megatron-ppo train: error: the driver does not support "
                       f"{['trainer.log_val_generations > 0']}. Nothing was run."], lines
