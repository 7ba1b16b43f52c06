"""Every `megatron-ppo train` / `make train` command line in README.md's code blocks passes config loading and the
train entry's refusal check (nothing is trained); commands marked "needs checkpointing" must be refused.
A README command that the driver would refuse is a defect this test catches."""
import re
import shlex
from pathlib import Path

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.config.checks import unsupported_settings
from megatron_ppo.trainer.entry import _parser

REPO = Path(__file__).resolve().parents[2]
MARK = "needs checkpointing"


def _make_train_argv() -> list[str]:
    """The Makefile's train recipe, without the binary and `$(ARGS)`."""
    recipe = re.search(r"^train:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    words = shlex.split(recipe)
    assert words[1] == "train" and words[-1] == "$(ARGS)", recipe
    return words[2:-1]


def _readme_commands() -> list[tuple[str, list[str], bool]]:
    """(line, train argv, marked as needing checkpointing) for each train command in a fenced block."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            if not re.search(r"(megatron-ppo|make) train\b", command):
                continue
            words = shlex.split(command)
            if words[:2] == ["make", "train"]:
                args = [w.partition("=")[2] for w in words[2:] if w.startswith("ARGS=")]
                out.append((line, _make_train_argv() + shlex.split(" ".join(args)), MARK in comment))
            elif len(words) >= 2 and words[0].endswith("megatron-ppo") and words[1] == "train":
                out.append((line, words[2:], MARK in comment))
    return out


COMMANDS = _readme_commands()


def test_the_readme_has_train_commands():
    """The README's runnable train commands are checked below; since checkpointing landed, none needs marking (a
    marked one must still be refused: test_readme_train_command)."""
    assert sum(not marked for _, _, marked in COMMANDS) >= 3


@pytest.mark.parametrize("line, argv, marked", COMMANDS, ids=[c[0][:60] for c in COMMANDS])
def test_readme_train_command(line, argv, marked):
    args = _parser().parse_args(argv)
    refused = unsupported_settings(load_config(args.config, args.overrides))
    if marked:
        assert refused, f"README marks {line!r} as needing checkpointing, but it runs today: unmark it"
    else:
        assert not refused, f"README command {line!r} is refused by the driver ({refused})"


def test_readme_commands_run_one_after_another():
    """Each plain `megatron-ppo train` example writes its own log dir, so running the README's commands in turn is
    not refused for a log dir an earlier one filled (`make train` overwrites its own)."""
    owners: dict[str, str] = {}
    make_dirs = set()
    for line, argv, marked in COMMANDS:
        args = _parser().parse_args(argv)
        t = load_config(args.config, args.overrides).trainer
        log_dir = t.expand(t.log_dir)
        if line.startswith("make"):
            assert t.overwrite, "make train is meant to be re-run: it must pass trainer.overwrite=true"
            make_dirs.add(log_dir)
        elif not marked and not t.overwrite:
            assert log_dir not in owners, f"{line!r} and {owners[log_dir]!r} both log to {log_dir}"
            owners[log_dir] = line
    assert not make_dirs & set(owners), "a plain `megatron-ppo train` example logs into make train's directory"
