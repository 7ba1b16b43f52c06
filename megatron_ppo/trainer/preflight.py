"""Preflight: every input of a training run checked in seconds, before torch, Megatron or Ray start.

A wrong file, column, reward function, output directory, logger or model path is reported as one `PreflightError`
naming the config key, the file and the fix, instead of a traceback after a minute of model building. Checks:
  data       data.train_files / data.val_files: exist, are parquet, have data_source, the prompt column and
             reward_model.ground_truth (no nulls), and at least one data.train_batch_size batch
  rewards    a reward function for every data_source present (or reward.custom_reward_function: importable, with
             verl's signature fn(data_source, solution_str, ground_truth, extra_info))
  outputs    trainer.log_dir, rollout.dump_dir, data.preprocess.output_dir writable
  loggers    tensorboard / wandb / swanlab installed; wandb logged in (or WANDB_MODE=offline|disabled)
  models     <role>.model.path: an HF directory with a config.json of a supported architecture, whose attention
             heads, KV heads, MLP width and layers the role's cluster.<role> TP and PP divide (config.checks' rule
             for `arch:` models; megatron-core would refuse the layout in every rank's setup, after Ray start-up)
  machine    cluster.device against torch.cuda.is_available(), and with cluster.launcher=ray the layout arithmetic
             (trainer.groups.plan): last, as they import torch (which the run imports next anyway)
Only then is "preflight ok" logged. `megatron-ppo train --dry-run` stops after these checks and prints
`describe_plan`.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_ppo.data.schema import SchemaError, check_prompt_column
from megatron_ppo.errors import UsageError

log = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")  # as convert/mapping.py (not imported: it loads torch)
RUN_DIR_FILES = ("metrics.jsonl", "run.json", "train.log")  # what a run rewrites in trainer.log_dir before step 1


class PreflightError(UsageError):
    """An input of the run is wrong; the message names the key, the file and what to do (exit code 2)."""


@dataclass
class DataSummary:
    key: str
    files: list[str]
    rows: int  # after data.<split>_max_samples, before prompt-length filtering (tokenising is for the run)
    data_sources: set = field(default_factory=set)


def _first_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_writable(key: str, directory: str, files: tuple[str, ...] = ()) -> None:
    """`directory` exists and takes a file, or can be created, and its `files` that exist can be rewritten: tried for
    real (root ignores permission bits; a broken symlink or a name too long only shows when the directory is made),
    and the directories the trial made are removed again (a dry run leaves nothing)."""
    path = Path(directory).absolute()
    try:
        base = _first_existing(path)
    except OSError as exc:  # e.g. a name too long
        raise PreflightError(f"{key}={directory}: {exc.strerror}; choose another {key}") from None
    if not base.is_dir():
        raise PreflightError(f"{key}={directory}: {base} is a file, not a directory; choose another {key}")
    made: list[Path] = []
    try:
        for d in [*reversed(path.relative_to(base).parents), path.relative_to(base)][1:]:
            d = base / d
            if d.is_symlink():  # exists() was false: it points nowhere
                raise PreflightError(f"{key}={directory}: {d} is a symlink to {os.readlink(d)}, which does not "
                                     f"exist; create its target or choose another {key}")
            d.mkdir()
            made.append(d)
        with tempfile.TemporaryFile(dir=path):
            pass
        for name in files:
            f = path / name
            if f.is_dir() or (f.exists() and not os.access(f, os.W_OK)):
                raise PreflightError(f"{key}={directory}: {f} is {'a directory' if f.is_dir() else 'not writable'}"
                                     f"; remove it or choose another {key}")
    except OSError as exc:
        where = exc.filename or path
        raise PreflightError(f"{key}={directory}: cannot write in {where} ({exc.strerror}); choose a writable "
                             f"{key}") from None
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass


def _parquet_files(key: str, entries: list[str]) -> list[Path]:
    from megatron_ppo.data.parquet_io import expand_parquet_paths

    out = []
    for i, entry in enumerate(entries):
        try:
            out += expand_parquet_paths(entry, what=f"{key}[{i}]")
        except FileNotFoundError as exc:
            raise PreflightError(f"{exc}; fix {key} (a parquet file or a directory of them)") from None
    return out


def check_data_files(cfg, key: str, max_samples: int, prompts: bool = True) -> DataSummary:
    """Schema, ground truth and row count of every file under `key` (prompts=True: prompt parquet scored online;
    False: only that each is a parquet file), read column by column (fast)."""
    section, name = key.split(".")
    files = _parquet_files(key, list(getattr(getattr(cfg, section), name)))
    prompt_key = cfg.data.prompt_key
    summary = DataSummary(key, [str(f) for f in files], 0)
    budget = max_samples if max_samples > 0 else None
    for path in files:
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise PreflightError(f"{key}: {path} is not a parquet file ({str(exc).splitlines()[0]})") from None
        if not prompts:
            continue
        need = {"data_source": "the reward function is chosen by it",
                prompt_key: "the chat messages (data.prompt_key)",
                "reward_model": "reward_model.ground_truth is what responses are scored against"}
        missing = [f"{c!r} ({why})" for c, why in need.items() if c not in schema.names]
        if missing:
            raise PreflightError(f"{key}: {path} has no column {', '.join(missing)}; columns present: "
                                 f"{schema.names} (megatron-ppo preprocess writes verl's schema)")
        try:  # its type from the schema alone (PromptDataset checks the same on read, minutes later)
            check_prompt_column(schema, str(path), prompt_key)
        except SchemaError as exc:
            raise PreflightError(f"{key}: {exc}" + ("" if prompt_key == "prompt" else " (data.prompt_key)")) from None
        table = pq.ParquetFile(path).read(columns=["data_source", "reward_model"])  # (read_table loads pandas)
        if budget is not None:
            table = table.slice(0, budget)
            budget -= table.num_rows
        if table.num_rows == 0 and budget != 0:
            raise PreflightError(f"{key}: {path} has no rows")
        rm = table.column("reward_model")
        if not pa.types.is_struct(rm.type) or rm.type.get_field_index("ground_truth") < 0:
            raise PreflightError(f"{key}: {path}: column 'reward_model' is {rm.type}, not a struct with "
                                 "'ground_truth'")
        rows = [r for r, v in enumerate(rm.to_pylist()) if v is None or v.get("ground_truth") is None]
        if rows:
            raise PreflightError(f"{key}: {path}: reward_model.ground_truth is null in {len(rows)} row(s), first "
                                 f"row {rows[0]}; every row needs one to be scored")
        summary.rows += table.num_rows
        summary.data_sources |= set(table.column("data_source").to_pylist())
        if budget == 0:
            break
    return summary


def check_rewards(cfg, data_sources: set) -> None:
    custom = cfg.reward.custom_reward_function
    if custom.path:
        from megatron_ppo.rewards.registry import load_custom_reward_fn

        try:
            fn = load_custom_reward_fn(custom.path, custom.name)
        except FileNotFoundError:
            raise PreflightError(f"reward.custom_reward_function.path={custom.path}: no such file") from None
        except AttributeError as exc:
            raise PreflightError(str(exc).replace("custom_reward_function.name", "reward.custom_reward_function.name")
                                 ) from None
        except Exception as exc:  # noqa: BLE001 - the user's file failed to import: say which and why
            raise PreflightError(f"reward.custom_reward_function.path={custom.path}: importing it failed: "
                                 f"{type(exc).__name__}: {exc}") from None
        try:
            inspect.signature(fn).bind("src", "solution", "truth", None)
        except TypeError:
            raise PreflightError(f"reward.custom_reward_function: {custom.path}:{custom.name}{inspect.signature(fn)}"
                                 " cannot be called as fn(data_source, solution_str, ground_truth, extra_info)"
                                 ) from None
        except ValueError:  # no signature (a builtin): trust it
            pass
        return
    from megatron_ppo.rewards.registry import registered_data_sources

    known = set(registered_data_sources())
    unknown = sorted(str(s) for s in data_sources - known)
    if unknown:
        raise PreflightError(f"no reward function for data_source {unknown} (in data.train_files/val_files); "
                             f"registered: {sorted(known)}. Set reward.custom_reward_function.path, or register "
                             "one with @megatron_ppo.rewards.register_reward")


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def check_loggers(cfg) -> None:
    packages = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}
    for name in cfg.trainer.logger:
        pkg = packages.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise PreflightError(f"trainer.logger includes {name!r}, but the {pkg} package is not installed "
                                 f"(pip install {pkg}, or drop {name!r} from trainer.logger)")
    if "wandb" in cfg.trainer.logger and not _wandb_logged_in():
        raise PreflightError("trainer.logger includes 'wandb', but wandb is not logged in (no WANDB_API_KEY, no "
                             "api.wandb.ai in ~/.netrc): run `wandb login`, set WANDB_MODE=offline, or drop 'wandb' "
                             "from trainer.logger")


def _model_key(role: str) -> str:
    from megatron_ppo import roles

    return roles.spec(role).model_key


def check_model_paths(cfg) -> None:
    from megatron_ppo import roles

    for role in cfg.roles:
        model = cfg.model_for(role)
        for attr in ("path", "tokenizer_path"):
            value = getattr(model, attr, None)
            key = f"{_model_key(role)}.{attr}"
            if value is None:
                continue
            p = Path(value)
            if not p.exists():
                raise PreflightError(f"{key}={value}: no such directory (an HF model directory with config.json)")
            if not p.is_dir():
                raise PreflightError(f"{key}={value}: is a file; expected an HF directory")
            if attr == "tokenizer_path":
                continue
            config = p / "config.json"
            if not config.is_file():
                raise PreflightError(f"{key}={value}: no config.json in it (is it an HF model directory? a Megatron "
                                     "checkpoint is converted with `megatron-ppo convert mcore-to-hf`)")
            try:
                hf_config = json.loads(config.read_text())
                model_type = hf_config.get("model_type")
            except (OSError, ValueError, AttributeError) as exc:
                raise PreflightError(f"{key}={value}: config.json is not readable JSON ({exc})") from None
            if model_type not in SUPPORTED_MODEL_TYPES:
                raise PreflightError(f"{key}={value}: model_type {model_type!r} is not supported (supported: "
                                     f"{', '.join(SUPPORTED_MODEL_TYPES)})")
            scorer = any(str(a).endswith("ForSequenceClassification") for a in hf_config.get("architectures") or [])
            spec = roles.spec(role)
            if spec.value_model and not spec.trainable and not scorer:  # a frozen value model: a reward model
                raise PreflightError(f"{key}={value}: architectures {hf_config.get('architectures')} is not a reward "
                                     "model: give an HF *ForSequenceClassification checkpoint with num_labels=1 (a "
                                     "causal LM's score head would be random)")
            if not spec.value_model and scorer:
                raise PreflightError(f"{key}={value}: architectures {hf_config.get('architectures')} is a reward "
                                     "model (no LM head); the actor and reference need a causal LM")
            check_hf_layout(cfg, role, config, hf_config)


# config.json's names for what the layout splits (config.checks names them as ArchConfig does); the MLP width too:
# megatron-core refuses intermediate_size % TP at build (models/gpt.py). The vocab is padded to a multiple of
# make_vocab_size_divisible_by x TP (ModelArch.padded_vocab_size), so any vocab_size takes any TP; and hidden_size
# need not be a multiple of num_attention_heads (arch_from_hf_config keeps HF's head_dim as kv_channels).
HF_COUNT_NAMES = {"num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
                  "num_layers": "num_hidden_layers"}
HF_TP_BUILD_COUNTS = ("intermediate_size",)


def _hf_count(hf_config: dict, name: str):
    value = hf_config.get(name)
    if name == "num_key_value_heads" and value is None:
        value = hf_config.get("num_attention_heads")  # transformers' default: multi-head attention
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _listed(values: list, last: str = "or") -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def check_hf_layout(cfg, role: str, config: Path, hf_config: dict) -> None:
    """cluster.<role> TP and PP against the counts of the role's HF config.json, as config.checks does for `arch:`.
    A count that is missing or not a positive int is left to the model build (arch_from_hf_config names it)."""
    from megatron_ppo.config.checks import PP_SPLIT_COUNTS, TP_SPLIT_COUNTS, layout_split_problems, sizes_that_split

    from megatron_ppo import roles

    own = roles.spec(role).own_model_config(cfg)
    owner = f"{_model_key(role)}.path" if own.path is not None else "actor.model.path"  # critic/ref: inherited
    names = {"tensor_model_parallel_size": [HF_COUNT_NAMES[n] for n in TP_SPLIT_COUNTS] + list(HF_TP_BUILD_COUNTS),
             "pipeline_model_parallel_size": [HF_COUNT_NAMES[n] for n in PP_SPLIT_COUNTS]}
    counts = {size_key: {n: c for n in hf_names if (c := _hf_count(hf_config, n)) is not None}
              for size_key, hf_names in names.items()}
    parallel = getattr(cfg.cluster, role)
    problems = layout_split_problems(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                     counts["tensor_model_parallel_size"], counts["pipeline_model_parallel_size"])
    if not problems:
        return
    parts = []
    for size_key, split in counts.items():
        bad = [(name, count) for name, count, k, _ in problems if k == size_key]
        if not bad:
            continue
        size = getattr(parallel, size_key)
        good = sizes_that_split(split.values())
        must = (f"; {'TP' if size_key.startswith('tensor') else 'PP'} must divide "
                f"{_listed([f'{n}={c}' for n, c in split.items()], 'and')}") if len(split) > 1 else ""
        parts.append(f"cluster.{role}.{size_key}={size} cannot split the {role}'s model {owner}="
                     f"{cfg.model_for(role).path}: {_listed([f'{n}={c}' for n, c in bad], 'and')} "
                     f"{'is' if len(bad) == 1 else 'are'} not divisible by {size} ({config}){must}: set "
                     f"cluster.{role}.{size_key} to {'one of ' if len(good) > 2 else ''}{_listed(good)}")
    raise PreflightError("; and ".join(parts))


def _preprocess_outputs(cfg) -> set[Path]:
    """Files preprocessing will write on first use (they may not exist yet: checked after it ran)."""
    pre = cfg.data.preprocess
    if pre.dataset is None or not pre.output_dir:
        return set()
    from megatron_ppo.data.gsm8k import SPLITS

    return {(Path(pre.output_dir) / f"{s}.parquet").absolute() for s in SPLITS}


def run_preflight(cfg, machine: bool = True) -> dict:
    """All checks; raises PreflightError at the first problem, then logs "preflight ok". Returns what describe_plan
    prints. machine=False leaves out cluster.device and the layout arithmetic (check_machine), which import torch."""
    start = time.monotonic()
    t = cfg.trainer
    check_writable("trainer.log_dir", t.expand(t.log_dir), RUN_DIR_FILES)
    if cfg.rollout.dump_dir:
        check_writable("rollout.dump_dir", cfg.rollout.dump_dir)
    check_loggers(cfg)
    check_model_paths(cfg)
    if cfg.rollout.name == "vllm":
        from megatron_ppo.rollout.vllm import check_vllm_python
        from megatron_ppo.trainer.vllm_preflight import check_engine_layout

        try:
            check_engine_layout(cfg)  # the engines' TP x PP against the replicas' GPUs; a shared weights_dir
            check_vllm_python(cfg.rollout.vllm)
        except UsageError as e:
            raise PreflightError(str(e)) from e
    pending = _preprocess_outputs(cfg)
    if pending and not all(p.is_file() for p in pending):
        check_writable("data.preprocess.output_dir", cfg.data.preprocess.output_dir)
        from megatron_ppo.data.gsm8k import default_gsm8k_dir

        source = Path(cfg.data.preprocess.input_dir) if cfg.data.preprocess.input_dir else default_gsm8k_dir()
        for split in ("train", "test"):
            if not (source / f"{split}.jsonl").is_file():
                raise PreflightError(f"data.preprocess.input_dir: {source / f'{split}.jsonl'} not found (GSM8K "
                                     "jsonl; set data.preprocess.input_dir or $MEGATRON_PPO_GSM8K_DIR)")
    summaries = {}
    if cfg.rollout.mode != "online":  # offline PPO replays trajectory files; prompt files are only listed
        if cfg.rollout.trajectory_files:
            check_data_files(cfg, "rollout.trajectory_files", -1, prompts=False)
        for key in ("train_files", "val_files"):
            if getattr(cfg.data, key):
                check_data_files(cfg, f"data.{key}", -1, prompts=False)
        if machine:
            check_machine(cfg)
        log.info("preflight ok (offline trajectories) in %.1f s", time.monotonic() - start)
        return {"data": summaries}
    for key, max_samples in (("train_files", cfg.data.train_max_samples), ("val_files", cfg.data.val_max_samples)):
        entries = getattr(cfg.data, key)
        if not entries:
            continue
        if pending and all(Path(e).absolute() in pending and not Path(e).exists() for e in entries):
            continue  # written by preprocessing at the start of the run
        summaries[key] = check_data_files(cfg, f"data.{key}", max_samples)
    train = summaries.get("train_files")
    if train is not None and train.rows < cfg.data.train_batch_size:
        capped = (f" (data.train_max_samples={cfg.data.train_max_samples})" if cfg.data.train_max_samples > 0 else "")
        raise PreflightError(f"data.train_batch_size={cfg.data.train_batch_size} > the {train.rows} rows of "
                             f"data.train_files {train.files}{capped}: no batch fits; lower data.train_batch_size "
                             "or add data")
    check_rewards(cfg, set().union(*(s.data_sources for s in summaries.values())) if summaries else set())
    if machine:
        check_machine(cfg)
    rows = f"{train.rows} train rows, " if train is not None else ""
    log.info("preflight ok (%sdata sources %s) in %.1f s; next: %s start-up and model build (a minute or more on "
             "CPU)", rows, sorted(set().union(*(s.data_sources for s in summaries.values()))) if summaries else [],
             time.monotonic() - start, "Ray" if cfg.cluster.launcher == "ray" else "in-process rank")
    return {"data": summaries}


def describe_plan(cfg, checked: dict) -> str:
    """The resolved plan `--dry-run` prints: layout, batch arithmetic, steps."""
    d, t = cfg.data, cfg.trainer
    lines = ["preflight: ok (config, data, rewards, output dirs, loggers, model paths and layouts, device)"]
    c = cfg.cluster
    lines.append(f"cluster: launcher={c.launcher} device={c.device} nnodes={c.nnodes} "
                 f"n_gpus_per_node={c.n_gpus_per_node}")
    for role in cfg.roles:
        p = getattr(c, role)
        model = cfg.model_for(role)
        source = model.path or ("inline arch" if model.arch is not None else "actor's architecture")
        lines.append(f"  {role:<6} TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
                     f"DP={p.data_parallel_size if p.data_parallel_size is not None else 'fill'}  model: {source}")
    train = checked["data"].get("train_files")
    rows = train.rows if train else None
    n = cfg.rollout.n
    lines.append(f"data: {rows if rows is not None else '?'} train rows (before prompt-length filtering)"
                 + (f" from {', '.join(train.files)}" if train else " (written by preprocessing at start)"))
    per_epoch = rows // d.train_batch_size if rows else None
    steps = t.total_training_steps or ((max(per_epoch, 1) * t.total_epochs) if per_epoch else None)
    lines.append(f"batch: {d.train_batch_size} prompts x rollout.n={n} = {d.train_batch_size * n} responses per step; "
                 f"actor mini-batch {cfg.actor.ppo_mini_batch_size}, micro-batch "
                 f"{cfg.actor.ppo_micro_batch_size_per_gpu}/GPU, ppo_epochs={cfg.actor.ppo_epochs}")
    lines.append(f"steps: {steps if steps is not None else '?'}"
                 + (" (trainer.total_training_steps)" if t.total_training_steps else
                    f" ({per_epoch} per epoch x trainer.total_epochs={t.total_epochs})" if per_epoch else ""))
    lines.append(f"outputs: metrics/logs in {t.expand(t.log_dir)}"
                 + (f"; rollouts in {cfg.rollout.dump_dir}" if cfg.rollout.dump_dir else ""))
    return "\n".join(lines)


def check_machine(cfg) -> None:
    """cluster.device against this machine and, with cluster.launcher=ray, the arithmetic of placing every rank
    (trainer.groups.plan; LayoutError with the numbers), before any process starts. Both import torch."""
    if cfg.cluster.device != "auto":
        import torch

        check_device(cfg, torch.cuda.is_available())
    if cfg.cluster.launcher == "ray":
        from megatron_ppo.distributed import LayoutError
        from megatron_ppo.trainer.groups import plan

        try:
            plan(cfg)
        except LayoutError as exc:
            raise PreflightError(f"{exc}. Nothing was run.") from exc


def check_device(cfg, cuda_available: bool) -> None:
    """cluster.device against this machine: cuda without CUDA is refused (PreflightError naming the key); cpu on a CUDA
    machine is warned about (the ranks use CUDA whenever it is there; tiny_cpu.yaml says cpu and
    should still run on a GPU box). Checked where training starts, not at config load: configs for GPU clusters
    are validated on CPU machines."""
    device = cfg.cluster.device
    if device == "cuda" and not cuda_available:
        raise PreflightError("cluster.device=cuda, but torch.cuda.is_available() is false on this machine (the run "
                         "would go to the CPU); set cluster.device=auto or cpu, or run where CUDA is. Nothing was run.")
    if device == "cpu" and cuda_available:
        logging.getLogger(__name__).warning(
            "cluster.device=cpu, but this machine has CUDA, which the ranks use whenever it is "
            "available: this run goes to the GPU (hide the GPUs with CUDA_VISIBLE_DEVICES= to run on the CPU)")
