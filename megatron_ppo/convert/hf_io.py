"""The HF side of conversion: read a checkpoint's tensors (or a rank's slices of them) on demand, check its
inventory against the config, write sharded safetensors, copy config files.

Reading never unpickles: safetensors via ``safe_open`` (headers first, tensors one at a time, memory-mapped), and
legacy ``pytorch_model*.bin`` only through ``torch.load(weights_only=True, mmap=True)``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ppo.convert.mapping import HF_EMBED, ConversionError, classify_hf_names, hf_tensor_shapes

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".onnx")
WEIGHT_INDEXES = (SAFETENSORS_INDEX, BIN_INDEX)
MAX_COPIED_FILE_BYTES = 256 << 20  # tokenizer.json of large-vocab models is tens of MB

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: cannot read JSON ({e})") from e


class HFCheckpoint:
    """Tensor inventory of an HF model directory (name -> file, shape, dtype), from file headers only."""

    def __init__(self, hf_dir: str):
        if not os.path.isdir(hf_dir):
            raise ConversionError(f"--hf {hf_dir}: not a directory")
        self.dir = hf_dir
        self.entries: dict[str, TensorEntry] = {}
        self.bytes_read = 0  # by read_slice: what a rank's import read
        self._bin: tuple[str, dict] | None = None  # read_slice's memory-mapped .bin file, one at a time
        files = sorted(os.listdir(hf_dir))
        st_files = [f for f in files if f.endswith(".safetensors")]
        bin_files = [f for f in files if f.startswith("pytorch_model") and f.endswith(".bin")]
        if SAFETENSORS_INDEX in files or st_files:
            self.format = "safetensors"
            self._index(SAFETENSORS_INDEX if SAFETENSORS_INDEX in files else None, st_files, self._safetensors_header)
        elif BIN_INDEX in files or bin_files:
            self.format = "bin"
            self._index(BIN_INDEX if BIN_INDEX in files else None, bin_files, self._bin_header)
        else:
            raise ConversionError(f"--hf {hf_dir}: no *.safetensors or pytorch_model*.bin weights found")

    def _index(self, index_name, files, read_header) -> None:
        weight_map = None
        if index_name is not None:
            index_path = os.path.join(self.dir, index_name)
            weight_map = _read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index_path}: no 'weight_map'")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not os.path.isfile(os.path.join(self.dir, f)):
                    raise ConversionError(f"{index_path}: lists shard {f}, which does not exist")
        for f in files:
            for name, (shape, dtype) in read_header(os.path.join(self.dir, f)).items():
                if name in self.entries:
                    raise ConversionError(f"tensor {name!r} appears in both {self.entries[name].file} and {f}")
                self.entries[name] = TensorEntry(f, shape, dtype)
        if weight_map is not None:
            index_path = os.path.join(self.dir, index_name)
            for name, f in weight_map.items():
                got = self.entries.get(name)
                if got is None or got.file != f:
                    where = "missing" if got is None else f"found in {got.file}"
                    raise ConversionError(f"{index_path}: maps {name!r} to {f}, but it is {where}")
            extra = sorted(set(self.entries) - set(weight_map))
            if extra:
                raise ConversionError(f"{index_path}: shards hold tensors the index does not list: {extra[:10]}")

    @staticmethod
    def _safetensors_header(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        try:
            with safe_open(path, framework="pt") as f:
                out = {}
                for name in f.keys():
                    sl = f.get_slice(name)
                    dtype = sl.get_dtype()
                    if dtype not in _ST_DTYPES:
                        raise ConversionError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
                    out[name] = (tuple(sl.get_shape()), _ST_DTYPES[dtype])
                return out
        except ConversionError:
            raise
        except Exception as e:  # safetensors raises its own error type for truncated/corrupt files
            raise ConversionError(f"{path}: not a valid safetensors file ({e})") from e

    @staticmethod
    def _bin_header(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        sd = _load_bin(path)
        return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors; files are opened for this call only, so nothing stays mapped between pieces."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.entries[n].file, []).append(n)
        out = {}
        for fname, group in by_file.items():
            path = os.path.join(self.dir, fname)
            if self.format == "safetensors":
                try:
                    with safe_open(path, framework="pt") as f:
                        for n in group:
                            out[n] = f.get_tensor(n)
                except Exception as e:
                    raise ConversionError(f"{path}: reading {group[0]!r} failed ({e})") from e
            else:
                sd = _load_bin(path)
                for n in group:
                    out[n] = sd[n]
                del sd
        for n, t in out.items():
            e = self.entries[n]
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ConversionError(f"{self.entries[n].file}: {n!r} read as {tuple(t.shape)} {t.dtype}, "
                                      f"header says {e.shape} {e.dtype}")
        return out

    def read_slice(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        """Rows [rows.start, rows.stop) (and columns ``cols``) of one tensor, reading no more of it than that:
        safetensors' ``get_slice(name)[...]``, or a slice of a memory-mapped .bin tensor. The file is opened for
        this read only (a safetensors file); a .bin stays mapped until another file is read. Counted in
        ``bytes_read``."""
        e = self.entries[name]
        index = (rows,) if cols is None else (rows, cols)
        path = os.path.join(self.dir, e.file)
        try:
            if self.format == "safetensors":
                with safe_open(path, framework="pt") as f:
                    t = f.get_slice(name)[index]
            else:
                if self._bin is None or self._bin[0] != e.file:
                    self._bin = None  # drop the previous file's mapping before mapping the next
                    self._bin = (e.file, _load_bin(path))
                t = self._bin[1][name][index]
        except ConversionError:
            raise
        except Exception as ex:
            raise ConversionError(f"{path}: reading rows {rows.start}:{rows.stop} of {name!r} failed ({ex})") from ex
        want = [rows.stop - rows.start, *e.shape[1:]]
        if cols is not None:
            want[1] = len(range(*cols.indices(e.shape[1])))
        if list(t.shape) != want or t.dtype != e.dtype:
            raise ConversionError(f"{path}: rows {rows.start}:{rows.stop} of {name!r} read as {tuple(t.shape)} "
                                  f"{t.dtype}, expected {tuple(want)} {e.dtype}")
        self.bytes_read += t.numel() * t.element_size()
        return t


def check_hf_inventory(arch, ck: HFCheckpoint) -> dict[str, list[str]]:
    """Every expected tensor present with the right shape and a float dtype, nothing unknown: one error listing
    all problems (headers only: nothing is read). Returns ``classify_hf_names``' classes."""
    expected = hf_tensor_shapes(arch)
    classes = classify_hf_names(arch, ck.entries)
    problems = []
    missing = [n for n in expected if n not in ck.entries]
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if classes["unknown"]:
        problems.append(f"unknown tensors {_few(classes['unknown'])}")
    for n in classes["expected"] + classes["tied_duplicate"]:
        want = expected.get(n, expected[HF_EMBED])
        got = ck.entries[n].shape
        if got != want:
            problems.append(f"tensor {n!r} in {ck.entries[n].file} has shape {got}, expected {want}")
        if not ck.entries[n].dtype.is_floating_point:
            problems.append(f"tensor {n!r} in {ck.entries[n].file} has non-float dtype {ck.entries[n].dtype}")
    if problems:
        raise ConversionError(f"--hf {ck.dir}: checkpoint does not match its config "
                              f"({arch.extra.get('hf_model_type')}, {arch.num_layers} layers): " + "; ".join(problems))
    return classes


def _few(names: list[str], n: int = 10) -> str:
    return f"{names[:n]}" + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ConversionError(f"{path}: cannot load with torch.load(weights_only=True, mmap=True) ({e})") from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConversionError(f"{path}: is not a flat dict of tensors")
    return sd


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------
def parse_size(text: str | int) -> int:
    """'2GB' / '500MB' / '1GiB' / bytes -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    units = {"GIB": 1 << 30, "MIB": 1 << 20, "KIB": 1 << 10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for u, mult in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mult)
    return int(s)


class ShardedSafetensorsWriter:
    """Writes tensors (in plan order) into safetensors shards of at most ``max_shard_bytes`` plus an index.

    The shard layout is planned up front from the known names/shapes/dtypes, so only the shard being filled is
    held in memory; every planned tensor must arrive exactly once, with the planned shape and dtype.
    """

    def __init__(self, out_dir: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        self.out_dir = out_dir
        self.plan = {name: (shape, dtype) for name, shape, dtype in plan}
        shards: list[list[str]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = _nbytes(shape, dtype)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shard_of = {name: i for i, names in enumerate(shards) for name in names}
        self.pending = [set(names) for names in shards]
        self.buffers: list[dict[str, torch.Tensor]] = [dict() for _ in shards]
        self.written: set[str] = set()
        self.total_bytes = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for shards not yet complete."""
        return sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.plan:
            raise ConversionError(f"HF writer: {name!r} is not a tensor of the target model")
        if name in self.written or name in self.buffers[self.shard_of[name]]:
            raise ConversionError(f"HF writer: {name!r} written twice")
        shape, dtype = self.plan[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ConversionError(f"HF writer: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"expected {shape} {dtype}")
        i = self.shard_of[name]
        self.buffers[i][name] = tensor.contiguous()
        self.pending[i].discard(name)
        if not self.pending[i]:
            self._flush(i)

    def _flush(self, i: int) -> None:
        tensors = self.buffers[i]
        save_file(tensors, os.path.join(self.out_dir, self.files[i]), metadata={"format": "pt"})
        self.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.written.update(tensors)
        self.buffers[i] = {}

    def finish(self) -> list[str]:
        missing = sorted(set(self.plan) - self.written)
        if missing:
            raise ConversionError(f"HF writer: {len(missing)} tensors never written, e.g. {missing[:5]}")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: self.files[self.shard_of[name]] for name in self.plan}}
            with open(os.path.join(self.out_dir, SAFETENSORS_INDEX), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")
        return list(self.files)


def _nbytes(shape, dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def verify_written(out_dir: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]]) -> HFCheckpoint:
    """Re-read the written headers: exactly the planned tensors, with the planned shapes and dtypes."""
    ck = HFCheckpoint(out_dir)
    want = {n: (s, d) for n, s, d in plan}
    got = {n: (e.shape, e.dtype) for n, e in ck.entries.items()}
    if want != got:
        diff = sorted(set(want) ^ set(got)) or sorted(n for n in want if want[n] != got[n])
        raise ConversionError(f"HF output {out_dir}: written tensors differ from the plan: {diff[:10]}")
    return ck


def copy_non_weight_files(src_dir: str, dst_dir: str, rewrite_config: dict | None = None) -> list[str]:
    """Copy config, generation config and tokenizer files (every top-level non-weight file) from src to dst.

    ``rewrite_config`` updates fields of config.json (e.g. the dtype) instead of copying it byte for byte.
    """
    copied = []
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if not os.path.isfile(src) or name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES:
            if os.path.isdir(src):
                logger.info("not copied (a directory): %s", src)
            continue
        if os.path.getsize(src) > MAX_COPIED_FILE_BYTES:
            raise ConversionError(f"{src}: {os.path.getsize(src)} bytes is too large for a config/tokenizer file")
        dst = os.path.join(dst_dir, name)
        if name == "config.json" and rewrite_config:
            cfg = _read_json(src)
            cfg.update(rewrite_config)
            with open(dst, "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
                f.write("\n")
        else:
            shutil.copyfile(src, dst)
        copied.append(name)
    return copied
