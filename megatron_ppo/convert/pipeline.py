"""HF <-> Megatron checkpoint conversion, orchestrated: ``hf_to_mcore`` and ``mcore_to_hf`` stream a checkpoint
through the mapping piece by piece and prove completeness.

hf-to-mcore: an HF Llama/Qwen2 directory (safetensors, or pytorch_model*.bin read with weights_only) -> a Megatron
dist_checkpointing (torch_dist) checkpoint loadable at any TP/PP (the format the trainer saves and resumes from),
with the HF config and tokenizer files kept under ``<out>/hf_config``. mcore-to-hf: the way back, to sharded
safetensors + index + config/tokenizer files.

Both directions go one piece at a time (embedding, each layer, final norm + output layer; see convert/mapping.py),
so peak memory is about one layer plus, on the HF side, the safetensors shard being filled. Outputs are written to
a temporary sibling directory and renamed into place only after every check passed: a failed conversion leaves no
partial output behind. The command line is convert/cli.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time

import torch

from megatron_ppo.compat import mcore as mcore_compat
from megatron_ppo.convert.hf_io import (
    HFCheckpoint,
    ShardedSafetensorsWriter,
    check_hf_inventory,
    copy_non_weight_files,
    parse_size,
    verify_written,
)
from megatron_ppo.convert.ledger import Ledger, category_of
from megatron_ppo.convert.mapping import (
    EXTRA_STATE_KEYS,
    HF_EMBED,
    HF_LM_HEAD,
    ConversionError,
    arch_from_hf_config,
    conversion_pieces,
    hf_tensor_shapes,
    pp_layer_ranges,
    to_hf,
    to_mcore,
    validate_layout,
)
from megatron_ppo.convert.mcore_io import (
    DistCheckpointReader,
    DistCheckpointWriter,
    chunk_coverage_problems,
    sharded_objects,
    sharded_tensors,
    single_process_group,
)
from megatron_ppo.convert.report import ConversionReport, RssSampler, print_table, report_rows, rss_text
from megatron_ppo.file_modes import publish_tree
from megatron_ppo.models.vocab_rows import vocab_rows_problem

logger = logging.getLogger(__name__)

HF_CONFIG_SUBDIR = "hf_config"
MANIFEST = "convert_manifest.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")


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
        publish_tree(tmp)  # mkdtemp's 0700 and safetensors' 0600 would keep others out of the output
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


# ----------------------------------------------------------------------------------------------------------------
# HF -> Megatron
# ----------------------------------------------------------------------------------------------------------------
def hf_to_mcore(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, dtype: str | None = None,
                overwrite: bool = False, key_prefix: str = "", quiet: bool = False) -> ConversionReport:
    """Convert an HF Llama/Qwen2 checkpoint directory into a Megatron dist checkpoint at ``out_dir``."""
    t0 = time.perf_counter()
    arch = arch_from_hf_config(hf_dir)
    validate_layout(arch, tp, pp)
    target_dtype = DTYPES[dtype] if dtype not in (None, "auto") else None
    ck = HFCheckpoint(hf_dir)
    classes = check_hf_inventory(arch, ck)
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
                logger.debug("%s saved: %s", piece.name, rss_text())
            writer.finish()
        _verify_mcore_output(tmp, arch, tp, key_prefix, written_dtypes)
        ledger.check()
        manifest = {
            "format": "megatron dist_checkpointing (torch_dist)",
            "megatron_core": mcore_compat.version(),  # checked on read: an older megatron-core may not read it
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
        print_table(ledger.table(report_rows(report, [
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
        sharded.update(sharded_tensors(m, t, arch.num_layers, key_prefix))
    if piece.layer is not None:
        sharded.update(sharded_objects(key_prefix, piece.layer, arch.num_layers))
    return sharded, nbytes


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


def check_mcore_version(mcore_dir: str) -> None:
    """Refuse, naming both versions, a checkpoint written by a megatron-core too new for this one to read: the
    version our converter (MANIFEST) or trainer (models/checkpoint.py's META_FILE) stored, else the layout on disk
    (compat/mcore.py)."""
    from megatron_ppo.models.checkpoint import META_FILE

    written_by = None
    for name in (MANIFEST, META_FILE):
        path = os.path.join(mcore_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                written_by = json.load(f).get("megatron_core")
            break
    try:
        mcore_compat.check_readable(mcore_dir, written_by)
    except mcore_compat.McoreVersionError as e:
        raise ConversionError(str(e)) from e


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
        check_mcore_version(mcore_dir)
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
                    logger.debug("%s written: %s", piece.name, rss_text())
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
        print_table(ledger.table(report_rows(report, [
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
