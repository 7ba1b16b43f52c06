"""Write a set of parquet files as one unit, with a manifest that names them, and check files against it on read.

Why: preprocessing writes a train/test pair. Written one file at a time, a failure between the two leaves a new
train.parquet beside an old test.parquet, and the trainer would read the mixture. Here every file is written
complete into a temp dir beside the output dir (same filesystem) first; a failure there leaves the output dir
untouched. Then the files are moved in by one `os.replace` each, the manifest first. That is several renames, not
one atomic step, but each moves an already-complete file, and the manifest (rows and sha256 of every file of the
set) lands before the data: a crash between two renames leaves a manifest that does not match at least one file,
which `check_against_manifest` reports when the file is read. Files the manifest does not name are not checked.
SIGINT/SIGTERM during the renames are held until the last one is done (console.deferred_signals), so an
interrupted preprocess leaves either the old set or the complete new one.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_ppo.errors import UsageError

MANIFEST_NAME = "preprocess_manifest.json"
FORMAT = "megatron_ppo.preprocess/1"


class ManifestMismatchError(UsageError):
    """A file differs from what the manifest beside it records: it comes from another write of the set."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_set(out_dir: str | Path, tables: dict[str, pa.Table], info: dict | None = None) -> Path:
    """Write `{file name: table}` into `out_dir` together with MANIFEST_NAME (rows, sha256 per file, plus `info`,
    e.g. the source files' hashes). On any failure before the renames nothing in `out_dir` changes."""
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.writing-", dir=out_dir.parent))
    try:
        files = {}
        for name, table in tables.items():
            pq.write_table(table, tmp / name)
            _fsync(tmp / name)
            files[name] = {"rows": table.num_rows, "sha256": sha256_file(tmp / name)}
        manifest = {"format": FORMAT, "written": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), **(info or {}), "files": files}
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
        _fsync(tmp / MANIFEST_NAME)
        from megatron_ppo.console import deferred_signals

        with deferred_signals():  # Ctrl-C / SIGTERM: all renames or none (delivered after the last one)
            out_dir.mkdir(exist_ok=True)
            for name in [MANIFEST_NAME, *tables]:  # the manifest first: see the module docstring
                os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / MANIFEST_NAME


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def check_against_manifest(path: str | Path) -> None:
    """If a manifest beside `path` names it, the file must be the one written with that manifest."""
    path = Path(path)
    manifest_path = path.parent / MANIFEST_NAME
    if not manifest_path.is_file():
        return
    try:
        manifest = json.loads(manifest_path.read_text())
        entry = manifest["files"].get(path.name) if manifest.get("format") == FORMAT else None
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ManifestMismatchError(f"{manifest_path}: unreadable manifest ({exc}); re-run the preprocessing "
                                    "that writes this directory") from None
    if entry is None:
        return
    if sha256_file(path) != entry["sha256"]:
        others = ", ".join(sorted(n for n in manifest["files"] if n != path.name)) or "none"
        raise ManifestMismatchError(
            f"{path}: not the file {manifest_path} records (sha256 differs; rows expected {entry['rows']}): it was "
            f"written by another run than the other files of its set ({others}) or changed since. Re-run the "
            "preprocessing (`megatron-ppo preprocess ...`) into this directory, or delete it to have it rebuilt")
