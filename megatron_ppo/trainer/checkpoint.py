"""Trainer checkpoints on disk: the layout, atomic saving, finding what to resume, pruning.

    <trainer.default_local_dir>/
        latest_checkpointed_iteration.txt     the newest complete step (verl's name), written after the rename
        best_checkpointed_iteration.txt       trainer.save_best: the step that validated best (its dir is kept)
        best -> global_step_<N>               a link to it, for readers (`megatron-ppo eval --model <dir>/best`)
        global_step_<N>/
            actor/ critic/                    dist_checkpointing dirs: model + optimizer shards (any TP/PP/DP reloads)
            actor/hf_config/                  config + tokenizer of the HF model the run started from, if any
                                              (`megatron-ppo convert mcore-to-hf --mcore .../actor` exports it)
            worker_state_<role>.pt            per rank: lr schedule, target-KL guard, RNG states (tensors/ints only)
            driver_rng.pt                     the driver process's RNG states
            driver_state.json                 step, KL controller, sampler position, non-finite streaks, layouts
            config.yaml                       the run's resolved config (what `megatron-ppo eval` of actor/ reads:
                                              tokenizer, chat template, rewards, response length, layout)
            manifest.json                     every other file's size (and sha256 with trainer.verify_checkpoint=
                                              full), written last (trainer/checkpoint_manifest.py)

A checkpoint is written into ``global_step_<N>.tmp-<pid>`` and renamed when complete, so a ``global_step_<N>`` dir
is always complete and a crash in the middle of a save leaves the previous one loadable (the stale tmp dir is
removed by the next save). ``.pt`` files are read with ``torch.load(weights_only=True)``: no pickle of arbitrary
objects. The rename protects against a crash during the save; the manifest against damage after it: find_resume
checks the chosen step against it before Ray or any model starts, and resume_mode=auto falls back to the newest
step that verifies; verify_before_reading does the same for the commands that read one (eval, convert). torch is
imported only by the functions that read or write ``.pt`` files, so that the resume preflight, those checks and
`megatron-ppo checkpoint verify` stay light.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field

from megatron_ppo.errors import UsageError
from megatron_ppo.trainer import checkpoint_manifest as manifests

log = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
BEST_FILE = "best_checkpointed_iteration.txt"
BEST_LINK = "best"
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


def has_manifest(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, manifests.MANIFEST))


def step_dirs(root: str) -> list[int]:
    """Every ``global_step_<N>`` dir under ``root`` (complete or not; tmp dirs excluded), ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.match(name)))


def complete_steps(root: str) -> list[int]:
    """The steps with a complete checkpoint under ``root``, ascending (tmp dirs of unfinished saves excluded)."""
    return [s for s in step_dirs(root) if is_complete(step_dir(root, s))]


@dataclass
class StepCheck:
    """What verify_step found in one ``global_step_<N>`` dir: no problems = resumable as far as files can tell."""
    directory: str
    problems: list[manifests.Problem] = field(default_factory=list)
    manifest: dict | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self, limit: int = 4) -> str:
        """The problems on one line, each file with its full path and its expected and found size or digest."""
        lines = [f"{os.path.join(self.directory, str(p))}" for p in self.problems[:limit]]
        more = len(self.problems) - limit
        return "; ".join(lines + ([f"and {more} more (megatron-ppo checkpoint verify {self.directory})"]
                                  if more > 0 else []))


def _driver_state_problem(directory: str, strict: bool) -> manifests.Problem | None:
    """driver_state.json must be a JSON object (and, ``strict``, of this version's format): read in milliseconds
    here instead of failing after every rank has started."""
    try:
        with open(os.path.join(directory, DRIVER_STATE)) as f:
            state = json.load(f)
    except FileNotFoundError:
        return manifests.Problem(DRIVER_STATE, "missing", "a JSON file", "no file")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return manifests.Problem(DRIVER_STATE, "not readable", "JSON", f"{type(exc).__name__}: {exc}")
    if not isinstance(state, dict):
        return manifests.Problem(DRIVER_STATE, "not a JSON object", "an object", type(state).__name__)
    if strict and state.get("format") != FORMAT:
        return manifests.Problem(DRIVER_STATE, "another format", f"format {FORMAT}",
                                 f"format {state.get('format')!r}")
    return None


def verify_step(directory: str, full: bool = False) -> StepCheck:
    """Check one step dir against its manifest (sizes; ``full``: digests too) and read its driver state.
    A step saved before manifests existed is not checked file by file (a note says so)."""
    check = StepCheck(directory)
    try:
        check.manifest = manifests.read(directory)
    except manifests.ManifestError as exc:
        check.problems.append(manifests.Problem(manifests.MANIFEST, "not readable", f"format {manifests.FORMAT}",
                                               str(exc)))
        return check
    if check.manifest is None:
        check.notes.append(f"no {manifests.MANIFEST} (saved before manifests existed): not verified")
    else:
        check.problems += manifests.check(directory, check.manifest, full)
        if full and check.manifest.get("digest") is None:
            check.notes.append("no digests recorded (saved without trainer.verify_checkpoint=full): sizes checked")
        for role in check.manifest.get("pruned", []):
            check.notes.append(f"{role}/ deleted by trainer.max_{role}_ckpt_to_keep")
    if not any(p.path == DRIVER_STATE for p in check.problems):
        problem = _driver_state_problem(directory, strict=check.manifest is not None)
        check.problems += [problem] if problem else []
    return check


def find_resume(trainer_cfg) -> str | None:
    """The checkpoint dir trainer.resume_mode asks for, verified (trainer.verify_checkpoint) before anything starts:
    disable -> None; resume_path -> trainer.resume_from_path (a complete global_step_<N> dir; a damaged one is
    refused, naming the file); auto -> the newest complete one in default_local_dir that verifies, each damaged
    newer one skipped with a warning (none verifies: refused, never a silent fresh start)."""
    t = trainer_cfg
    if t.resume_mode == "disable":
        return None
    mode = t.verify_checkpoint
    if t.resume_mode == "resume_path":
        path = os.path.abspath(t.resume_from_path)
        name_ok = _STEP_DIR.match(os.path.basename(path.rstrip("/")))
        if name_ok and mode != "disable" and (is_complete(path) or has_manifest(path)):
            check = verify_step(path, mode == "full")
            if check.problems:
                raise CheckpointError(f"trainer.resume_from_path={t.resume_from_path}: damaged checkpoint: "
                                      f"{check.describe()} (trainer.resume_mode=auto falls back to the newest step "
                                      "that verifies)")
            _log_notes(check)
        if not name_ok or not is_complete(path):
            raise CheckpointError(f"trainer.resume_from_path={t.resume_from_path}: not a complete checkpoint "
                                  f"(a global_step_<N> directory holding {DRIVER_STATE})")
        return path
    root = t.expand(t.default_local_dir)
    steps = complete_steps(root)
    if mode != "disable":  # a manifest without driver_state.json is a damaged step, named (not silently passed over)
        steps = [s for s in step_dirs(root) if s in steps or has_manifest(step_dir(root, s))]
    if not steps:
        return None
    pointer = os.path.join(root, LATEST_FILE)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            text = f.read().strip()
        if text != str(steps[-1]):  # a crash between the rename and the pointer: the complete dir wins
            log.warning("%s says %r, but the newest complete checkpoint is step %d: resuming from that", pointer,
                        text, steps[-1])
    if mode == "disable":
        return step_dir(root, steps[-1])
    skipped = []
    for step in reversed(steps):
        check = verify_step(step_dir(root, step), mode == "full")
        pruned = (check.manifest or {}).get("pruned", [])
        if not check.problems and not pruned:
            if skipped:
                log.warning("trainer.resume_mode=auto: resuming from %s, the newest checkpoint that verifies "
                            "(skipped %s)", check.directory, ", ".join(f"global_step_{s}" for s, _ in skipped))
            _log_notes(check)
            return check.directory
        reason = check.describe(limit=2) if check.problems else (
            f"{check.directory}: " + ", ".join(f"{r}/ deleted by trainer.max_{r}_ckpt_to_keep" for r in pruned))
        log.warning("checkpoint global_step_%d is damaged or incomplete, skipped: %s", step, reason)
        skipped.append((step, reason))
    raise CheckpointError(f"trainer.resume_mode=auto: no checkpoint under {root} verifies: "
                          + "; ".join(f"global_step_{s}: {reason}" for s, reason in skipped)
                          + ". Move the damaged ones away, or set trainer.resume_mode=disable to start afresh")


def verify_before_reading(path: str, flag: str, role: str | None = None) -> StepCheck | None:
    """For a command that reads a trainer checkpoint (`eval --model`, `convert mcore-to-hf --mcore`, `convert
    verify --mcore`): ``path`` (a ``global_step_<N>/<role>`` dir, or ``global_step_<N>`` itself, then ``role``'s
    files, or every file when ``role`` is None) checked against its step's manifest before anything is imported or
    started (sizes: a stat per file, milliseconds). Only what such a reader uses is checked: the role's files and
    the run's config.yaml. A damaged one is refused (CheckpointError, exit 2) naming the file; a dir outside a
    ``global_step_<N>``, or a step saved before manifests, passes unchecked (None)."""
    path = os.path.abspath(resolve_link(path))
    if _STEP_DIR.match(os.path.basename(path)):
        step = path
    elif _STEP_DIR.match(os.path.basename(os.path.dirname(path))):
        step, role = os.path.dirname(path), os.path.basename(path)
    else:
        return None
    if not has_manifest(step):
        return None
    check = verify_step(step)
    if role is not None:
        read = (f"{role}/", RUN_CONFIG, manifests.MANIFEST)
        check.problems = [p for p in check.problems if p.path in read or p.path.startswith(read[0])]
    if check.problems:
        named = "; ".join(os.path.join(step, str(p)) for p in check.problems[:2])
        more = f"; and {len(check.problems) - 2} more" if len(check.problems) > 2 else ""
        raise CheckpointError(f"{flag} {path}: damaged checkpoint: {named}{more}. Nothing was run "
                              f"(`megatron-ppo checkpoint verify {step}` lists every file)")
    return check


def _log_notes(check: StepCheck) -> None:
    for note in check.notes:
        log.info("checkpoint %s: %s", check.directory, note)


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
    import torch

    torch.save(rng, os.path.join(tmp, DRIVER_RNG))
    with open(os.path.join(tmp, DRIVER_STATE), "w") as f:
        json.dump({"format": FORMAT, **state}, f, indent=1, sort_keys=True)


NEXT_BATCH = "next_batch.pt"  # trainer.async_rollout=one_step: the rollout generated ahead, for the next step


def write_next_batch(tmp: str, batch) -> None:
    import torch

    torch.save({"prompt_ids": batch.prompt_ids, "responses": batch.responses, "response_mask": batch.response_mask,
                "tensors": batch.tensors, "meta": batch.meta}, os.path.join(tmp, NEXT_BATCH))


def read_next_batch(directory: str):
    """The saved rollout generated ahead (a RolloutBatch), or None when the run saved none."""
    import torch

    from megatron_ppo.data.batch import RolloutBatch

    path = os.path.join(directory, NEXT_BATCH)
    if not os.path.isfile(path):
        return None
    saved = torch.load(path, weights_only=True)
    return RolloutBatch(saved["prompt_ids"], saved["responses"], saved["response_mask"], saved["tensors"],
                        saved["meta"])


def write_worker_states(tmp: str, role: str, rank_states: list[dict]) -> None:
    import torch

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


DIGEST_THREADS = min(8, os.cpu_count() or 1)


def finish_save(root: str, tmp: str, step: int, digests: bool = False) -> str:
    """Seal the complete tmp dir with its manifest (written last; ``digests``: sha256 of every file, on
    DIGEST_THREADS threads), rename it into place, then write the ``latest`` pointer (atomically, last)."""
    manifests.write(tmp, manifests.build(tmp, digests=digests, threads=DIGEST_THREADS))
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
    import torch

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
    import torch

    return torch.load(path, weights_only=True)


def prune(root: str, keep: dict[str, int | None], current: int, protect: tuple[int, ...] = ()) -> list[str]:
    """Delete the role dirs of the oldest checkpoints beyond keep[role] (None: keep all), never step ``current``
    nor a ``protect``ed one (save_best's step, kept beside the newest); a checkpoint left without any role's model
    is deleted whole. Returns what was deleted."""
    steps = [s for s in complete_steps(root) if s != current and s not in protect]
    gone = []
    for role, n in keep.items():
        if n is None:
            continue
        with_role = [s for s in steps if os.path.isdir(os.path.join(step_dir(root, s), role))]
        for s in with_role[: max(len(with_role) - (n - 1), 0)]:  # n - 1 older ones + the current one
            path = os.path.join(step_dir(root, s), role)
            manifests.mark_pruned(step_dir(root, s), role)  # first: a crash mid-delete leaves no "missing" file
            shutil.rmtree(path)
            gone.append(path)
    for s in steps:
        d = step_dir(root, s)
        if not any(os.path.isdir(os.path.join(d, role)) for role in keep):
            shutil.rmtree(d)
            gone.append(d)
    return gone


def mark_best(root: str, step: int | None) -> None:
    """Point BEST_FILE and the BEST_LINK symlink at ``step`` (each replaced atomically); None removes both."""
    pointer, link = os.path.join(root, BEST_FILE), os.path.join(root, BEST_LINK)
    if step is None:
        for path in (pointer, link):
            if os.path.lexists(path):
                os.remove(path)
        return
    with open(pointer + ".tmp", "w") as f:
        f.write(f"{step}\n")
    os.replace(pointer + ".tmp", pointer)
    if os.path.lexists(link + ".tmp"):
        os.remove(link + ".tmp")
    os.symlink(os.path.basename(step_dir(root, step)), link + ".tmp")  # relative: the root can move
    os.replace(link + ".tmp", link)


def best_step(root: str) -> int | None:
    """The step BEST_FILE names, or None (no save_best run wrote one)."""
    try:
        with open(os.path.join(root, BEST_FILE)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


def resolve_link(path: str) -> str:
    """``path`` with links resolved when that lands in a ``global_step_<N>`` dir (``<dir>/best``,
    ``<dir>/best/actor``), so readers check and name the real step; any other path unchanged."""
    real = os.path.realpath(path)
    if _STEP_DIR.match(os.path.basename(real)) or _STEP_DIR.match(os.path.basename(os.path.dirname(real))):
        return real
    return path
