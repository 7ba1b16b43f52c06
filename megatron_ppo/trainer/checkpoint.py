"""Trainer checkpoints on disk: the layout, atomic saving, finding what to resume, pruning.

    <trainer.default_local_dir>/
        latest_checkpointed_iteration.txt     the newest complete step (verl's name), written after the rename
        global_step_<N>/
            actor/ critic/                    dist_checkpointing dirs: model + optimizer shards (any TP/PP/DP reloads)
            actor/hf_config/                  config + tokenizer of the HF model the run started from, if any
                                              (`megatron-ppo convert mcore-to-hf --mcore .../actor` exports it)
            worker_state_<role>.pt            per rank: lr schedule, target-KL guard, RNG states (tensors/ints only)
            driver_rng.pt                     the driver process's RNG states
            driver_state.json                 step, KL controller, sampler position, non-finite streaks, layouts
            config.yaml                       the run's resolved config (what `megatron-ppo eval` of actor/ reads:
                                              tokenizer, chat template, rewards, response length, layout)

A checkpoint is written into ``global_step_<N>.tmp-<pid>`` and renamed when complete, so a ``global_step_<N>`` dir
is always complete and a crash in the middle of a save leaves the previous one loadable (the stale tmp dir is
removed by the next save). ``.pt`` files are read with ``torch.load(weights_only=True)``: no pickle of arbitrary
objects.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil

import torch

from megatron_ppo.errors import UsageError

log = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
DRIVER_STATE = "driver_state.json"
DRIVER_RNG = "driver_rng.pt"
RUN_CONFIG = "config.yaml"
FORMAT = 1
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(UsageError):
    """A checkpoint that cannot be resumed from (missing, incomplete, saved by another kind of run)."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def worker_state_file(directory: str, role: str) -> str:
    return os.path.join(directory, f"worker_state_{role}.pt")


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, DRIVER_STATE))


def complete_steps(root: str) -> list[int]:
    """The steps with a complete checkpoint under ``root``, ascending (tmp dirs of unfinished saves excluded)."""
    if not os.path.isdir(root):
        return []
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return sorted(s for s in steps if is_complete(step_dir(root, s)))


def find_resume(trainer_cfg) -> str | None:
    """The checkpoint dir trainer.resume_mode asks for: disable -> None; resume_path -> trainer.resume_from_path
    (must be a complete global_step_<N> dir); auto -> the newest complete one in default_local_dir, if any."""
    t = trainer_cfg
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        path = os.path.abspath(t.resume_from_path)
        if not _STEP_DIR.match(os.path.basename(path.rstrip("/"))) or not is_complete(path):
            raise CheckpointError(f"trainer.resume_from_path={t.resume_from_path}: not a complete checkpoint "
                                  f"(a global_step_<N> directory holding {DRIVER_STATE})")
        return path
    root = t.expand(t.default_local_dir)
    steps = complete_steps(root)
    if not steps:
        return None
    pointer = os.path.join(root, LATEST_FILE)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            text = f.read().strip()
        if text != str(steps[-1]):  # a crash between the rename and the pointer: the complete dir wins
            log.warning("%s says %r, but the newest complete checkpoint is step %d: resuming from that", pointer,
                        text, steps[-1])
    return step_dir(root, steps[-1])


def resume_step(directory: str) -> int:
    """The step a complete checkpoint dir holds (from its name, global_step_<N>)."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(directory)))
    if not m:
        raise CheckpointError(f"{directory}: not a global_step_<N> checkpoint directory")
    return int(m.group(1))


def begin_save(root: str, step: int) -> str:
    """A fresh tmp dir for step ``step``'s checkpoint; stale tmp dirs of unfinished saves are removed."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        if ".tmp-" in name and name.startswith("global_step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    tmp = os.path.join(root, f"global_step_{step}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    return tmp


def write_driver_state(tmp: str, state: dict, rng: dict) -> None:
    torch.save(rng, os.path.join(tmp, DRIVER_RNG))
    with open(os.path.join(tmp, DRIVER_STATE), "w") as f:
        json.dump({"format": FORMAT, **state}, f, indent=1, sort_keys=True)


def write_worker_states(tmp: str, role: str, rank_states: list[dict]) -> None:
    torch.save(rank_states, worker_state_file(tmp, role))


HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def write_run_config(tmp: str, config_text: str) -> None:
    with open(os.path.join(tmp, RUN_CONFIG), "w") as f:
        f.write(config_text)


def copy_hf_config(hf_path: str | None, role_dir: str) -> None:
    """A run started from an HF model keeps its config and tokenizer files (not weights) in
    ``<role_dir>/hf_config``, where `megatron-ppo convert mcore-to-hf --mcore <role_dir>` looks by default."""
    if not hf_path or not os.path.isfile(os.path.join(hf_path, "config.json")):
        return
    from megatron_ppo.convert.pipeline import HF_CONFIG_SUBDIR

    out = os.path.join(role_dir, HF_CONFIG_SUBDIR)
    os.makedirs(out, exist_ok=True)
    for name in HF_FILES:
        if os.path.isfile(os.path.join(hf_path, name)):
            shutil.copy2(os.path.join(hf_path, name), os.path.join(out, name))


def finish_save(root: str, tmp: str, step: int) -> str:
    """Rename the complete tmp dir into place, then write the ``latest`` pointer (atomically, last)."""
    final = step_dir(root, step)
    if os.path.exists(final):  # a re-save of the same step (e.g. resumed, then preempted at once)
        old = final + f".old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    pointer = os.path.join(root, LATEST_FILE)
    with open(pointer + ".tmp", "w") as f:
        f.write(f"{step}\n")
    os.replace(pointer + ".tmp", pointer)
    return final


def read_driver_state(directory: str) -> tuple[dict, dict]:
    with open(os.path.join(directory, DRIVER_STATE)) as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{directory}/{DRIVER_STATE}: format {state.get('format')!r}, this version reads "
                              f"{FORMAT}")
    return state, torch.load(os.path.join(directory, DRIVER_RNG), weights_only=True)


def read_worker_states(directory: str, role: str) -> list[dict]:
    path = worker_state_file(directory, role)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory}: no {role} state ({os.path.basename(path)}); was the run saved without "
                              f"a {role}?")
    return torch.load(path, weights_only=True)


def prune(root: str, keep: dict[str, int | None], current: int) -> list[str]:
    """Delete the role dirs of the oldest checkpoints beyond keep[role] (None: keep all), never step ``current``;
    a checkpoint left without any role's model is deleted whole. Returns what was deleted."""
    steps = [s for s in complete_steps(root) if s != current]
    gone = []
    for role, n in keep.items():
        if n is None:
            continue
        with_role = [s for s in steps if os.path.isdir(os.path.join(step_dir(root, s), role))]
        for s in with_role[: max(len(with_role) - (n - 1), 0)]:  # n - 1 older ones + the current one
            path = os.path.join(step_dir(root, s), role)
            shutil.rmtree(path)
            gone.append(path)
    for s in steps:
        d = step_dir(root, s)
        if not any(os.path.isdir(os.path.join(d, role)) for role in keep):
            shutil.rmtree(d)
            gone.append(d)
    return gone
