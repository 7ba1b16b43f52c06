"""`megatron-ppo convert hf-to-mcore | mcore-to-hf | verify`: checkpoint conversion that streams and proves
completeness.

hf-to-mcore: an HF Llama/Qwen2 directory (safetensors, or pytorch_model*.bin read with weights_only) -> a Megatron
dist_checkpointing (torch_dist) checkpoint loadable at any TP/PP (the format the trainer saves and resumes from),
with the HF config and tokenizer files kept under ``<out>/hf_config``. mcore-to-hf: the way back, to sharded
safetensors + index + config/tokenizer files.

Both directions go one piece at a time (embedding, each layer, final norm + output layer; see hf_mapping.py), so
peak memory is about one layer plus, on the HF side, the safetensors shard being filled. Outputs are written to a
temporary sibling directory and renamed into place only after every check passed: a failed conversion leaves no
partial output behind.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from megatron_ppo.models.convert_hf_io import (
    HFCheckpoint,
    ShardedSafetensorsWriter,
    copy_non_weight_files,
    parse_size,
    verify_written,
)
from megatron_ppo.models.convert_ledger import Ledger, category_of
from megatron_ppo.models.convert_mcore_io import (
    DistCheckpointReader,
    DistCheckpointWriter,
    chunk_coverage_problems,
    single_process_group,
)
from megatron_ppo.models.hf_mapping import (
    EXTRA_STATE_KEYS,
    HF_EMBED,
    HF_LM_HEAD,
    ConversionError,
    arch_from_hf_config,
    classify_hf_names,
    conversion_pieces,
    hf_tensor_shapes,
    pp_layer_ranges,
    tp_chunks,
    to_hf,
    to_mcore,
    validate_layout,
)
from megatron_ppo.models.vocab_rows import vocab_rows_problem

logger = logging.getLogger(__name__)

HF_CONFIG_SUBDIR = "hf_config"
MANIFEST = "convert_manifest.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")


@dataclass
class ConversionReport:
    direction: str
    out_dir: str
    seconds: float
    peak_rss_bytes: int  # sampled while converting (after imports)
    peak_anon_rss_bytes: int  # the same without file-backed (memory-mapped) pages
    baseline_rss_bytes: int  # RSS when the piece loop started
    baseline_anon_rss_bytes: int
    largest_piece_bytes: int  # the biggest unit held at once (a layer, the embedding, or an HF shard + a layer)
    ledger: dict
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_output_dir(final: str, overwrite: bool = False):
    """Yield a temporary sibling of ``final``; rename it into place on success, delete it on any failure."""
    final = os.path.abspath(final)
    if os.path.exists(final) and not os.path.isdir(final):
        raise ConversionError(f"--out {final}: exists and is not a directory")
    if os.path.isdir(final) and os.listdir(final) and not overwrite:
        raise ConversionError(f"--out {final}: exists and is not empty (pass --overwrite to replace it)")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        if os.path.isdir(final):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rss_text() -> str:
    import psutil

    info = psutil.Process().memory_info()
    return f"RSS {_fmt_bytes(info.rss)} (file-backed/shared {_fmt_bytes(info.shared)})"


class RssSampler:
    """Peak resident set size of this process while a block runs (a thread samples it every ``interval`` s).

    ``baseline`` is the RSS on entry, after the imports: peak - baseline is what the conversion itself held.
    ``peak_anon`` leaves out file-backed pages (memory-mapped safetensors), which the kernel can drop at will.
    """

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.baseline = self.baseline_anon = self.peak = self.peak_anon = 0
        self._stop = None

    def _sample(self, proc) -> None:
        info = proc.memory_info()
        self.peak = max(self.peak, info.rss)
        self.peak_anon = max(self.peak_anon, info.rss - info.shared)

    def __enter__(self):
        import threading

        import psutil

        self._proc = psutil.Process()
        info = self._proc.memory_info()
        self.baseline, self.baseline_anon = info.rss, info.rss - info.shared
        self._sample(self._proc)
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(self.interval):
                self._sample(self._proc)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample(self._proc)


def _print_table(table) -> None:
    from rich.console import Console

    Console(width=110).print(table)


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


# ----------------------------------------------------------------------------------------------------------------
# HF -> Megatron
# ----------------------------------------------------------------------------------------------------------------
def _check_hf_inventory(arch, ck: HFCheckpoint) -> dict[str, list[str]]:
    """Every expected tensor present with the right shape, nothing unknown: one error listing all problems."""
    expected = hf_tensor_shapes(arch)
    classes = classify_hf_names(arch, ck.entries)
    problems = []
    missing = [n for n in expected if n not in ck.entries]
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if classes["unknown"]:
        unknown = classes["unknown"]
        problems.append(f"unknown tensors {_few(unknown)}")
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


def _sharded_objects(key_prefix: str, layer: int, num_layers: int) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {}
    for key in EXTRA_STATE_KEYS:
        obj = ShardedObject(key_prefix + key, None, (num_layers,), (layer,), replica_id=0)
        out[obj.unique_key] = obj
    return out


def _sharded_tensors(m, tensor: torch.Tensor, num_layers: int, key_prefix: str) -> dict:
    """The ShardedTensors a TP-sharded trainer would save for this tensor: one per TP shard (tp_parts chunks)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    key = key_prefix + m.mcore_key
    layer_offsets = () if m.layer is None else ((0, m.layer, num_layers),)
    shift = 0 if m.layer is None else 1
    chunks = [tensor] if m.tp_axis is None else tp_chunks(tensor, m.tp_axis, m.tp_parts)
    out = {}
    for r, chunk in enumerate(chunks):
        data = chunk if m.layer is None else chunk.unsqueeze(0)
        tp_offsets = () if m.tp_axis is None else ((m.tp_axis + shift, r, m.tp_parts),)
        out[f"{key}@{m.layer}#{r}"] = ShardedTensor.from_rank_offsets(key, data, *layer_offsets, *tp_offsets,
                                                                      replica_id=0)
    return out


def hf_to_mcore(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
                overwrite: bool = False, key_prefix: str = "", quiet: bool = False) -> ConversionReport:
    """Convert an HF Llama/Qwen2 checkpoint directory into a Megatron dist checkpoint at ``out_dir``."""
    t0 = time.perf_counter()
    arch = arch_from_hf_config(hf_dir)
    validate_layout(arch, tp, pp)
    target_dtype = DTYPES[dtype] if dtype not in (None, "auto") else None
    ck = HFCheckpoint(hf_dir)
    classes = _check_hf_inventory(arch, ck)
    pieces = conversion_pieces(arch, tp)
    L = arch.num_layers

    ledger = Ledger("HF -> Megatron")
    for n in hf_tensor_shapes(arch):
        ledger.expect_source(n, ck.entries[n].numel, category_of(n))
    for n in classes["derived"]:
        ledger.skip(n, "derived buffer (rotary inv_freq, recomputed)")
    for piece in pieces:
        for m in piece.maps:
            ledger.expect_target((m.mcore_key, m.layer), m.numel, category_of(m.mcore_key))

    written_dtypes: dict[str, torch.dtype] = {}
    with atomic_output_dir(out_dir, overwrite) as tmp, single_process_group():
        os.makedirs(os.path.join(tmp, HF_CONFIG_SUBDIR))
        copied = copy_non_weight_files(hf_dir, os.path.join(tmp, HF_CONFIG_SUBDIR))
        writer = DistCheckpointWriter(tmp)
        largest = 0
        with RssSampler() as rss:
            for piece in pieces:
                sharded, nbytes = _mcore_piece(piece, ck, arch, classes, target_dtype, key_prefix, ledger,
                                               written_dtypes)
                largest = max(largest, nbytes)
                writer.save_piece(piece.name, sharded)
                del sharded
                logger.debug("%s saved: %s", piece.name, _rss_text())
            writer.finish()
        _verify_mcore_output(tmp, arch, tp, key_prefix, written_dtypes)
        ledger.check()
        manifest = {
            "format": "megatron dist_checkpointing (torch_dist)",
            "source": os.path.abspath(hf_dir),
            "arch": arch.to_dict(),
            "tp": tp, "pp": pp,
            "pp_layer_ranges": [[r.start, r.stop] for r in pp_layer_ranges(L, pp)],
            "padded_vocab_size": arch.padded_vocab_size(tp),
            "key_prefix": key_prefix,
            "dtypes": {k: str(v).replace("torch.", "") for k, v in written_dtypes.items()},
            "hf_config_files": copied,
            "ledger": ledger.summary(),
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
    report = ConversionReport("hf-to-mcore", os.path.abspath(out_dir), time.perf_counter() - t0, rss.peak,
                              rss.peak_anon, rss.baseline, rss.baseline_anon, largest, ledger.summary(),
                              files=sorted(os.listdir(out_dir)))
    if not quiet:
        _print_table(ledger.table(_report_rows(report, [
            ("layout", f"TP={tp} PP={pp}, stages hold layers "
                       + ", ".join(f"{r.start}-{r.stop - 1}" for r in pp_layer_ranges(L, pp))),
            ("padded vocab", f"{arch.vocab_size} -> {arch.padded_vocab_size(tp)}"),
        ])))
    return report


def _mcore_piece(piece, ck, arch, classes, target_dtype, key_prefix, ledger, written_dtypes) -> tuple[dict, int]:
    """Read one piece's HF tensors, map them, and return (its ShardedTensors/Objects, bytes they hold)."""
    names = list(piece.hf_names)
    if piece.name == "embedding" and classes["tied_duplicate"]:
        names.append(HF_LM_HEAD)
    hf = ck.read(names)
    if HF_LM_HEAD in hf and arch.tie_word_embeddings:
        if not torch.equal(hf.pop(HF_LM_HEAD), hf[HF_EMBED]):
            raise ConversionError(f"--hf {ck.dir}: tie_word_embeddings is true but {HF_LM_HEAD} differs from "
                                  f"{HF_EMBED}")
        ledger.skip(HF_LM_HEAD, "tied duplicate of the embedding (checked equal)")
    sharded, nbytes = {}, 0
    for m in piece.maps:
        dts = {hf[n].dtype for n in m.hf_names}
        if len(dts) > 1:
            raise ConversionError(f"{m.hf_names} are fused into {m.mcore_key} but have dtypes {sorted(map(str, dts))}")
        t = to_mcore(m, hf, arch)
        if target_dtype is not None:
            t = t.to(target_dtype)
        for n in m.hf_names:
            ledger.consume(n)
        ledger.write((m.mcore_key, m.layer), t.numel())
        if m.kind == "vocab":
            ledger.padding_added += (m.shape[0] - arch.vocab_size) * m.shape[1]
        if written_dtypes.setdefault(m.mcore_key, t.dtype) != t.dtype:
            raise ConversionError(f"{m.mcore_key}: layer {m.layer} is {t.dtype}, earlier layers "
                                  f"{written_dtypes[m.mcore_key]} (one dtype per checkpoint tensor)")
        nbytes += t.numel() * t.element_size()
        sharded.update(_sharded_tensors(m, t, arch.num_layers, key_prefix))
    if piece.layer is not None:
        sharded.update(_sharded_objects(key_prefix, piece.layer, arch.num_layers))
    return sharded, nbytes


def _report_rows(report: ConversionReport, rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return rows + [
        ("time", f"{report.seconds:.1f} s"),
        ("memory", f"peak RSS {_fmt_bytes(report.peak_rss_bytes)} = {_fmt_bytes(report.baseline_rss_bytes)} before "
                   f"converting + {_fmt_bytes(report.peak_rss_bytes - report.baseline_rss_bytes)} "
                   f"(anonymous: +{_fmt_bytes(report.peak_anon_rss_bytes - report.baseline_anon_rss_bytes)}); "
                   f"largest piece held "
                   f"{_fmt_bytes(report.largest_piece_bytes)}"),
        ("output", report.out_dir),
    ]


def _verify_mcore_output(ckpt_dir: str, arch, tp: int, key_prefix: str, dtypes: dict) -> None:
    """Re-read the merged metadata: exactly the expected keys, global shapes, dtypes, and chunks tiling each tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    reader = DistCheckpointReader(ckpt_dir)
    want = {}
    for piece in conversion_pieces(arch, tp):
        for m in piece.maps:
            want[key_prefix + m.mcore_key] = (m.shape if m.layer is None else (arch.num_layers,) + m.shape,
                                              dtypes[m.mcore_key])
    got = {k: (v.shape, v.dtype) for k, v in reader.tensors.items()}
    if want != got:
        diff = sorted(set(want) ^ set(got)) or sorted(k for k in want if want[k] != got[k])
        raise ConversionError(f"Megatron output: written tensors differ from the expected ones: {diff[:10]}")
    for key, (shape, _) in want.items():
        problem = chunk_coverage_problems(shape, reader.chunks[key])
        if problem:
            raise ConversionError(f"Megatron output: {key}: {problem}")
    want_objects = {ShardedObject(key_prefix + k, None, (arch.num_layers,), (i,), replica_id=0).unique_key
                    for k in EXTRA_STATE_KEYS for i in range(arch.num_layers)}
    if set(reader.objects) != want_objects:
        raise ConversionError(f"Megatron output: _extra_state objects differ: "
                              f"{sorted(set(reader.objects) ^ want_objects)[:10]}")


# ----------------------------------------------------------------------------------------------------------------
# Megatron -> HF
# ----------------------------------------------------------------------------------------------------------------
def _check_mcore_inventory(reader: DistCheckpointReader, arch, key_prefix: str, ledger: Ledger) -> dict[str, tuple]:
    """Map every stored key: expected model tensors (shape-checked, fully covered), known skips, or an error."""
    pieces = conversion_pieces(arch, 1)
    expected = {}
    for piece in pieces:
        for m in piece.maps:
            expected[key_prefix + m.mcore_key] = m
    problems = []
    for key, m in expected.items():
        st = reader.tensors.get(key)
        if st is None:
            problems.append(f"missing tensor {key!r}")
            continue
        inner = st.shape if m.layer is None else st.shape[1:]
        if m.layer is not None and st.shape[0] != arch.num_layers:
            problems.append(f"{key!r} stacks {st.shape[0]} layers, the config has {arch.num_layers}")
        if m.kind == "vocab":  # any layout's padded vocab, never another vocabulary (vocab_rows)
            rows_problem = vocab_rows_problem(inner[0], arch)
            if inner[1:] != m.shape[1:] or rows_problem:
                problems.append(f"{key!r} has shape {st.shape}, expected [vocab rows, {m.shape[1]}]"
                                + (f": {rows_problem}" if rows_problem else ""))
                continue
        elif inner != m.shape:
            problems.append(f"{key!r} has shape {st.shape}, expected {m.shape} per layer")
            continue
        problem = chunk_coverage_problems(st.shape, reader.chunks[key])
        if problem:
            problems.append(f"{key!r}: {problem}")
    model_prefixes = tuple(key_prefix + p for p in MODEL_KEY_PREFIXES)
    for key in reader.tensors:
        if key in expected:
            continue
        if key.startswith(model_prefixes):
            problems.append(f"unknown model tensor {key!r} {reader.tensors[key].shape}")
        else:
            ledger.skip(key, "not model weights (e.g. optimizer state)")
    for key in reader.objects:
        base = key.split("/shard_")[0]
        if base.startswith(model_prefixes) and base.endswith("._extra_state"):
            ledger.skip(key, "weightless _extra_state object")
        elif base.startswith(model_prefixes):
            problems.append(f"unknown model object {key!r}")
        else:
            ledger.skip(key, "not model weights (e.g. optimizer state)")
    if problems:
        raise ConversionError(f"--mcore {reader.dir}: checkpoint does not match the HF config "
                              f"({arch.num_layers} layers): " + "; ".join(problems))
    return {key: reader.tensors[key] for key in expected}


def mcore_to_hf(mcore_dir: str, out_dir: str, hf_config: str | None = None, dtype: str | None = None,
                overwrite: bool = False, max_shard_size: str | int = "2GB", key_prefix: str = "",
                quiet: bool = False) -> ConversionReport:
    """Convert a Megatron dist checkpoint (any TP/PP) back to an HF safetensors directory at ``out_dir``."""
    t0 = time.perf_counter()
    cfg_dir = hf_config or os.path.join(mcore_dir, HF_CONFIG_SUBDIR)
    if not os.path.isfile(os.path.join(cfg_dir, "config.json")):
        raise ConversionError(f"no HF config at {cfg_dir}/config.json: pass --hf-config DIR (an HF model directory "
                              "with config.json and tokenizer files)")
    arch = arch_from_hf_config(cfg_dir)
    out_dtype = DTYPES[dtype] if dtype not in (None, "auto") else None
    ledger = Ledger("Megatron -> HF")
    with single_process_group():
        reader = DistCheckpointReader(mcore_dir)
        stored = _check_mcore_inventory(reader, arch, key_prefix, ledger)
        pieces = conversion_pieces(arch, 1)
        hf_shapes = hf_tensor_shapes(arch)
        hf_dtypes = {}
        for piece in pieces:
            for m in piece.maps:
                st = stored[key_prefix + m.mcore_key]
                ledger.expect_source((m.mcore_key, m.layer), _numel(st.shape[1:] if m.layer is not None else st.shape),
                                     category_of(m.mcore_key))
                for n in m.hf_names:
                    hf_dtypes[n] = out_dtype or st.dtype
                    ledger.expect_target(n, _numel(hf_shapes[n]), category_of(n))
        plan = [(n, hf_shapes[n], hf_dtypes[n]) for n in hf_shapes]
        notes: list[str] = []
        with atomic_output_dir(out_dir, overwrite) as tmp:
            writer = ShardedSafetensorsWriter(tmp, plan, parse_size(max_shard_size))
            largest = 0
            with RssSampler() as rss:
                for piece in pieces:
                    got = reader.read([(key_prefix + m.mcore_key, m.layer) for m in piece.maps])
                    piece_bytes = sum(t.numel() * t.element_size() for t in got.values())
                    largest = max(largest, piece_bytes + writer.buffered_bytes)
                    for m in piece.maps:
                        t = got.pop((key_prefix + m.mcore_key, m.layer))
                        ledger.consume((m.mcore_key, m.layer))
                        tensors, dropped = to_hf(m, t, arch)
                        if dropped is not None and dropped.numel():
                            ledger.padding_dropped += dropped.numel()
                            peak = float(dropped.abs().max())
                            if peak != 0.0:
                                notes.append(f"{m.mcore_key}: dropped {dropped.shape[0]} vocab padding rows "
                                             f"(max |value| {peak:.3g}; unused token ids beyond the vocab)")
                        for n, x in tensors.items():
                            x = x.to(hf_dtypes[n])
                            writer.add(n, x)
                            ledger.write(n, x.numel())
                        del t, tensors
                    logger.debug("%s written: %s", piece.name, _rss_text())
                files = writer.finish()
            copied = copy_non_weight_files(cfg_dir, tmp, rewrite_config=_config_dtype_update(cfg_dir, hf_dtypes))
            verify_written(tmp, plan)
            ledger.check()
    report = ConversionReport("mcore-to-hf", os.path.abspath(out_dir), time.perf_counter() - t0, rss.peak,
                              rss.peak_anon, rss.baseline, rss.baseline_anon, largest, ledger.summary(),
                              files=files + copied, notes=notes)
    for note in notes:
        logger.warning(note)
    if not quiet:
        _print_table(ledger.table(_report_rows(report, [
            ("HF files", f"{len(files)} safetensors shard(s) + {len(copied)} config/tokenizer files"),
        ])))
    return report


def _config_dtype_update(cfg_dir: str, hf_dtypes: dict) -> dict | None:
    """config.json's dtype fields, if the written weights have one dtype that differs from the declared one."""
    kinds = set(hf_dtypes.values())
    if len(kinds) != 1:
        return None
    name = str(kinds.pop()).replace("torch.", "")
    with open(os.path.join(cfg_dir, "config.json")) as f:
        cfg = json.load(f)
    declared = {k: cfg[k] for k in ("dtype", "torch_dtype") if k in cfg}
    if declared and all(v == name for v in declared.values()):
        return None
    return {k: name for k in (declared or {"dtype": None})}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ----------------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------------
def verify(hf_dir: str, mcore_dir: str, tokens: int = 32, batch: int = 2, seed: int = 0) -> float:
    """Max |logit difference| between the HF model and the Megatron model (TP=1, PP=1, fp32) loaded from
    ``mcore_dir``, on random tokens. Holds both models in memory: meant for models that fit on one machine."""
    from transformers import AutoModelForCausalLM

    from megatron_ppo import parallel
    from megatron_ppo.models.convert_verify import load_dist_checkpoint, megatron_logits
    from megatron_ppo.models.gpt import build_gpt_model

    arch = arch_from_hf_config(hf_dir)
    ids = torch.randint(0, arch.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf_model(ids).logits.float()
    del hf_model
    parallel.initialize(tp=1, pp=1)
    try:
        model = build_gpt_model(arch).eval()
        load_dist_checkpoint(model, mcore_dir, strict=False)
        got = megatron_logits(model, ids, arch.vocab_size)
    finally:
        parallel.destroy()
    return float((got - want).abs().max())


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ppo convert", description="HF <-> Megatron checkpoint conversion")
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF Llama/Qwen2 directory -> Megatron dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors/bin + tokenizer)")
    a.add_argument("--out", required=True, help="output checkpoint directory (must not exist or be empty)")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size to pad the vocab for and shard by")
    a.add_argument("--pp", type=int, default=1, help="pipeline parallel size to validate the layer split for")
    a.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="stored dtype (auto: as in the HF files)")
    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors directory")
    b.add_argument("--mcore", required=True, help="Megatron dist checkpoint directory")
    b.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    b.add_argument("--hf-config", default=None,
                   help=f"HF directory with config.json + tokenizer (default: <mcore>/{HF_CONFIG_SUBDIR})")
    b.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="output dtype (auto: as stored)")
    b.add_argument("--max-shard-size", default="2GB",
                   help="largest safetensors shard, e.g. 2GB, 500MB (one shard is buffered in memory)")
    v = sub.add_parser("verify", help="compare the logits of an HF model and its converted Megatron checkpoint")
    v.add_argument("--hf", required=True, help="HF model directory")
    v.add_argument("--mcore", required=True, help="Megatron dist checkpoint converted from it")
    v.add_argument("--tokens", type=int, default=32, help="sequence length of the random test batch")
    v.add_argument("--tol", type=float, default=1e-4, help="largest acceptable |logit difference| (fp32)")
    for q in (a, b):
        q.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (atomically)")
        q.add_argument("--key-prefix", default="", help="prefix of the model's keys in the dist checkpoint")
        q.add_argument("--quiet", action="store_true", help="do not print the summary table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.direction == "verify":
            diff = verify(args.hf, args.mcore, tokens=args.tokens)
            ok = diff <= args.tol
            print(f"max |logit difference| HF vs Megatron: {diff:.3g} ({'ok' if ok else 'FAILED'}, tol {args.tol:g})")
            return 0 if ok else 1
        if args.direction == "hf-to-mcore":
            hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, overwrite=args.overwrite,
                        key_prefix=args.key_prefix, quiet=args.quiet)
        else:
            mcore_to_hf(args.mcore, args.out, hf_config=args.hf_config, dtype=args.dtype, overwrite=args.overwrite,
                        max_shard_size=args.max_shard_size, key_prefix=args.key_prefix, quiet=args.quiet)
    except ConversionError as e:
        print(f"megatron-ppo convert {args.direction}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
