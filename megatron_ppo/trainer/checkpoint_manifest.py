"""Checkpoint manifests: what every file of a ``global_step_<N>`` dir was when it was saved, so that damage after
the save (a full disk, a node lost mid-copy, a flipped bit) is found before a resume starts anything.

``manifest.json`` is the last file of a save, written atomically beside ``driver_state.json``::

    {"format": 1, "digest": "sha256" | null, "pruned": ["critic"],
     "files": {"actor/__0_0.distcp": {"size": 8392704, "sha256": "9f2c..."}, "driver_state.json": {"size": 612}, ...}}

``files`` lists every file of the step dir except the manifest itself (paths relative to it, ``/``-separated).
Digests (sha256: docs/bench/checkpoint.md for the choice) are recorded only by saves with
``trainer.verify_checkpoint=full``: at 70B a driver cannot read a step's terabytes at every save, while sizes cost a
``stat`` per file. ``pruned`` names the role dirs that ``max_<role>_ckpt_to_keep`` deleted later (their files are
dropped from ``files``: gone on purpose, not missing). Files on disk that the manifest does not list are not checked.

Pure (os, json, hashlib): the resume preflight and ``megatron-ppo checkpoint verify`` import nothing heavy.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MANIFEST = "manifest.json"
FORMAT = 1
DIGEST = "sha256"  # hashlib name; the fastest stdlib digest here that `sha256sum` can also check by hand
CHUNK = 8 << 20  # bytes per read while hashing


@dataclass(frozen=True)
class Problem:
    """One file that is not what the manifest says: ``path`` relative to the step dir."""
    path: str
    what: str  # missing | truncated | larger | altered | unreadable | ...
    expected: str
    found: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what} (expected {self.expected}, found {self.found})"


def list_files(directory: str) -> list[str]:
    """Every file under ``directory`` except the manifest (and its tmp file), relative, sorted."""
    out = []
    for here, dirs, files in os.walk(directory):
        dirs.sort()
        rel = os.path.relpath(here, directory)
        for name in files:
            path = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
            if path not in (MANIFEST, MANIFEST + ".tmp"):
                out.append(path)
    return sorted(out)


def file_digest(path: str, algorithm: str = DIGEST, chunk: int = CHUNK) -> str:
    """Hex digest of a file read in ``chunk``-byte pieces (hashlib releases the GIL: threads hash in parallel)."""
    h = hashlib.new(algorithm)
    buf = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def build(directory: str, digests: bool = False, threads: int = 8) -> dict:
    """The manifest of ``directory`` as it is now: sizes always, sha256 digests (over ``threads``) if asked."""
    paths = list_files(directory)
    files = {p: {"size": os.path.getsize(os.path.join(directory, p))} for p in paths}
    if digests:
        with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
            for p, d in zip(paths, pool.map(lambda p: file_digest(os.path.join(directory, p)), paths)):
                files[p][DIGEST] = d
    return {"format": FORMAT, "digest": DIGEST if digests else None, "pruned": [], "files": files}


def write(directory: str, manifest: dict) -> str:
    """Write ``manifest.json`` atomically (tmp file, fsync, rename): a reader sees the old one or the new one."""
    path = os.path.join(directory, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return path


class ManifestError(ValueError):
    """A manifest that exists but cannot be read: the step is damaged (it is written last, atomically)."""


def read(directory: str) -> dict | None:
    """The step's manifest; None when it has none (saved before manifests existed)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"),
                                                                                             dict):
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ManifestError(f"format {got!r}, this version reads {FORMAT} (with a 'files' table)")
    return manifest


def check(directory: str, manifest: dict, full: bool = False, threads: int = 8) -> list[Problem]:
    """The files of ``directory`` that differ from ``manifest``: missing, another size, and (``full``, where the
    manifest has digests) another digest. Sizes first, for every file; digests only of files of the right size."""
    problems, same_size = [], []
    for path, entry in sorted(manifest["files"].items()):
        want = int(entry["size"])
        try:
            size = os.path.getsize(os.path.join(directory, path))
        except FileNotFoundError:
            problems.append(Problem(path, "missing", f"{want} bytes", "no file"))
            continue
        if size != want:
            problems.append(Problem(path, "truncated" if size < want else "larger than saved", f"{want} bytes",
                                    f"{size}"))
        elif full and DIGEST in entry:
            same_size.append(path)
    if same_size:
        with ThreadPoolExecutor(max(1, min(threads, len(same_size)))) as pool:
            for path, got in zip(same_size, pool.map(lambda p: file_digest(os.path.join(directory, p)), same_size)):
                want = manifest["files"][path][DIGEST]
                if got != want:
                    problems.append(Problem(path, "altered", f"{DIGEST} {want[:16]}...", f"{got[:16]}..."))
    return problems


def mark_pruned(directory: str, role: str) -> None:
    """Before ``<directory>/<role>`` is deleted on purpose: its files leave the manifest, the role joins
    ``pruned`` (so a crash during the deletion leaves unlisted files, never "missing" ones)."""
    try:
        manifest = read(directory)
    except ManifestError:
        return  # already damaged: verification names it; pruning must not fail the run that is saving
    if manifest is None:
        return
    prefix = role.rstrip("/") + "/"
    manifest["files"] = {p: e for p, e in manifest["files"].items() if not p.startswith(prefix)}
    manifest["pruned"] = sorted(set(manifest.get("pruned", [])) | {role})
    write(directory, manifest)


# ------------------------------------------------------------------------------------------------ the command
def main(argv: list[str] | None = None) -> int:
    """`megatron-ppo checkpoint verify DIR [--full]`: a table of a run's checkpoints (DIR: trainer.default_local_dir,
    or one global_step_<N>) against their manifests. Exit 0: none damaged (steps saved before manifests are listed,
    not verified); 1: at least one damaged; 2: DIR holds no checkpoint."""
    import argparse

    p = argparse.ArgumentParser(prog="megatron-ppo checkpoint", description="trainer checkpoints on disk")
    sub = p.add_subparsers(dest="action", required=True)
    v = sub.add_parser("verify", help="check every file of a run's checkpoints against its manifest.json",
                       description=" ".join(main.__doc__.split()))
    v.add_argument("dir", help="a run's checkpoint dir (trainer.default_local_dir) or one global_step_<N> in it")
    v.add_argument("--full", action="store_true", help="compare sha256 digests too (reads every byte; only steps "
                   "saved with trainer.verify_checkpoint=full have them)")
    args = p.parse_args(argv)
    return verify_command(args.dir, args.full)


def verify_command(directory: str, full: bool = False) -> int:
    """The table, then every problem on its own line (full paths: grep-able), then a summary; the exit code."""
    import time

    from megatron_ppo.errors import UsageError
    from megatron_ppo.trainer import checkpoint as ckpt

    start, root = time.perf_counter(), os.path.abspath(directory)
    if not os.path.isdir(root):
        raise UsageError(f"{directory}: no such directory")
    try:
        ckpt.resume_step(root)
        dirs = [root]
    except ckpt.CheckpointError:
        dirs = [ckpt.step_dir(root, s) for s in ckpt.step_dirs(root)]
    if not dirs:
        raise UsageError(f"{directory}: no global_step_<N> directory in it (give trainer.default_local_dir or one "
                         "global_step_<N>)")
    checks = [ckpt.verify_step(d, full) for d in dirs]
    _print_table(checks, root, full)
    damaged = [c for c in checks if c.problems]
    for c in damaged:
        for problem in c.problems:
            print(f"{os.path.join(c.directory, str(problem))}")
    unverified = sum(c.manifest is None and not c.problems for c in checks)
    print(f"{len(checks)} checkpoint(s): {len(checks) - len(damaged) - unverified} ok, {len(damaged)} damaged, "
          f"{unverified} without a manifest (not verified); {_what_was_checked(checks, full)} in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return 1 if damaged else 0


def _what_was_checked(checks, full: bool) -> str:
    """'sizes', or with --full which steps' digests: only steps saved with trainer.verify_checkpoint=full have
    them, and saying "digests checked" of a step without any would be a false assurance."""
    if not full:
        return "sizes checked"
    with_digests = sum(c.manifest is not None and c.manifest.get("digest") == DIGEST for c in checks)
    if with_digests == 0:
        return ("sizes checked; no digests to check (none recorded: steps saved with trainer.verify_checkpoint=full "
                "have them)")
    if with_digests < len(checks):
        return f"sizes checked, and digests of the {with_digests} of {len(checks)} steps that recorded them"
    return "sizes and digests checked"


def _print_table(checks, root: str, full: bool) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{root}: checkpoints against their {MANIFEST} ({'sizes, sha256' if full else 'sizes'})")
    for name, justify in (("step", "left"), ("status", "left"), ("files", "right"), ("bytes", "right"),
                          ("problem / note", "left")):
        table.add_column(name, justify=justify)
    for c in checks:
        if c.manifest is not None:
            files = c.manifest["files"]
            count, size = len(files), sum(int(e["size"]) for e in files.values())
        else:
            paths = list_files(c.directory)
            count, size = len(paths), sum(os.path.getsize(os.path.join(c.directory, p)) for p in paths)
        status = "damaged" if c.problems else ("no manifest" if c.manifest is None else "ok")
        detail = str(c.problems[0]) + (f" (+{len(c.problems) - 1} more)" if len(c.problems) > 1 else "") \
            if c.problems else "; ".join(c.notes)
        table.add_row(os.path.basename(c.directory), status, str(count), f"{size:,}", detail,
                      style="red" if c.problems else None)
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
