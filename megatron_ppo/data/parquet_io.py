"""Parquet reading and atomic writing shared by the prompt and trajectory formats."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_ppo.data.manifest import check_against_manifest
from megatron_ppo.file_modes import umask_mode


def atomic_write_table(table: pa.Table, path: str | Path) -> Path:
    """Write `table` to `path` so readers see the old file or the whole new one, never a partial file. The file gets
    the mode a plain ``open`` would give (mkstemp's temp file is 0600: a dump others on the cluster cannot read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def expand_parquet_paths(paths: str | Path | Iterable[str | Path], what: str = "data_files") -> list[Path]:
    """Files as given; a directory stands for its *.parquet files in name order. Missing paths are an error."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.glob("*.parquet") if not q.name.startswith("."))
            if not found:
                raise FileNotFoundError(f"{what}: directory {p} holds no *.parquet files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{what}: {p} does not exist")
    if not out:
        raise ValueError(f"{what}: no files given")
    return out


def read_tables(paths: list[Path]) -> list[tuple[Path, pa.Table]]:
    """Each file with its table (kept apart so errors can name the file a row came from). A file named by a
    preprocessing manifest beside it must match it (data/manifest.py)."""
    out = []
    for p in paths:
        check_against_manifest(p)  # a file of a preprocessed set must be the one its manifest records
        try:
            out.append((p, pq.read_table(p)))
        except (pa.ArrowInvalid, OSError) as e:
            raise ValueError(f"{p}: cannot read as parquet ({e})") from None
    return out
