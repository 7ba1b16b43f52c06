"""The vLLM rollout engine (``rollout.name=vllm``): one vLLM process per node an actor DP replica spans, over the
replica's GPUs there (rollout/vllm_layout.py; one per replica on one node, on CPU always one), in its own
virtualenv (``make setup-vllm``: vLLM pins a transformers that verl, our test oracle, refuses), weights handed over
from the actor after every update.

Why managed subprocesses, not Ray actors: the actor's ranks run on Ray or on torchrun (launcher=local), and a Ray
actor with another Python needs Ray of the same version inside the vLLM venv; a child process of the engine's owner
rank (a first-TP rank on the engine's node; on the representative's node the representative, tp0 of the last
stage, whose answer the driver keeps) needs only the venv's Python, sits on that rank's node (where its GPUs and
/dev/shm are), and dies with it (the socket closes, its parent changes). docs/rollout.md, "The vLLM engine".

Each step: the actor updates (its ``weights_version`` grows), then ``sync_weights`` on every actor rank hands the
weights over (rollout.vllm.weight_transport): ``ipc``, buckets in memory (rollout/weight_buckets.py: gathered to
each stage's first TP rank, relayed stage by stage to every engine owner, shared with the engine's workers one
bucket at a time through vllm_channel.py: CUDA IPC on a GPU, shared memory on the CPU), or ``file``, safetensors
in one directory per DP replica (the replica's tp0 ranks agree on the files over the pipeline group; each owner
writes the manifest and asks its engine to load that version). The engines start from files either way. On a GPU
an engine sleeps while the actor trains (rollout/vllm_settings.py). ``generate`` refuses an engine whose version is
not the actor's (``StaleWeightsError``): an engine never generates with an old policy.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_ppo import parallel
from megatron_ppo.distributed.layout import RankLayout
from megatron_ppo.errors import UsageError
from megatron_ppo.rollout.base import GenerationOutput, SamplingParams
from megatron_ppo.rollout.vllm_channel import BucketChannel
from megatron_ppo.rollout.vllm_layout import engine_env, engine_for_rank, gather_rank_devices, plan_engines, rows_of
from megatron_ppo.rollout.vllm_settings import engine_options, kv_bytes_per_token, memory_fraction
from megatron_ppo.rollout.weight_buckets import relay_buckets
from megatron_ppo.rollout.weights import (StaleWeightsError, check_complete, finish_sync, remove_stage_files,
                                          write_hf_config, write_weights)

log = logging.getLogger(__name__)

SERVER_DIR = Path(__file__).resolve().parent / "vllm_process"
SERVER = SERVER_DIR / "mppo_vllm_server.py"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-vllm"
SETUP_COMMAND = "make setup-vllm"
POLL_S = 0.5
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm/v1/attention/backends/cpu_attn.py


class EngineError(RuntimeError):
    """The vLLM engine of a replica died, hung, failed to start or answered an error."""


def vllm_python(engine_cfg) -> Path:
    """The vLLM virtualenv's interpreter: rollout.vllm.python, else $MEGATRON_PPO_VLLM_PYTHON, else
    <repo>/.venv-vllm/bin/python."""
    return Path(engine_cfg.python or os.environ.get("MEGATRON_PPO_VLLM_PYTHON") or DEFAULT_VENV / "bin" / "python")


def check_vllm_python(engine_cfg) -> None:
    """Preflight: the interpreter exists and has vLLM; else a UsageError naming the setup command."""
    python = vllm_python(engine_cfg)
    if not python.exists():
        raise UsageError(f"rollout.name=vllm: no vLLM virtualenv interpreter at {python} (rollout.vllm.python / "
                         f"MEGATRON_PPO_VLLM_PYTHON); build it with `{SETUP_COMMAND}`")
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "raise SystemExit(0 if u.find_spec('vllm') else 1)"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        raise UsageError(f"rollout.name=vllm: {python} has no vllm package; build the venv with `{SETUP_COMMAND}`")


def logprobs_mode(cfg) -> str:
    """vLLM reports the sampled token's log-prob either before temperature (raw) or after temperature *and* top-k /
    top-p (processed). Ours are log_softmax(logits / T) over the full vocabulary: processed when no sampling section
    filters, raw when every filtering section has T = 1 (config/checks.py refuses the rest)."""
    sections = [cfg.rollout] + ([cfg.rollout.val_kwargs] if cfg.rollout.val_kwargs.do_sample else [])
    filters = [s for s in sections if s.do_sample and (s.top_k > 0 or s.top_p < 1.0)]
    return "raw_logprobs" if filters else "processed_logprobs"


class EngineProcess:
    """One vLLM server process (vllm_process/mppo_vllm_server.py) and the socket to it."""

    def __init__(self, python: Path, name: str, log_path: str, env: dict, start_timeout_s: float,
                 hang_timeout_s: float):
        from multiprocessing.connection import Connection

        self.name, self.log_path = name, log_path
        self.start_timeout_s, self.hang_timeout_s = start_timeout_s, hang_timeout_s
        ours, theirs = socket.socketpair()
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen([str(python), str(SERVER), str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                         env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # its own group: kill() takes vLLM's children too
        theirs.close()
        self.conn = Connection(ours.detach())
        self.calls = 0
        atexit.register(self.kill)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _exit_text(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        return f"exit code {code}" + (f", signal {signal.Signals(-code).name}" if code < 0 else "")

    def _log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 8192))
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n  | " + "\n  | ".join(tail) if tail else ""

    def fail(self, what: str) -> EngineError:
        self.kill()
        return EngineError(f"{self.name} (pid {self.pid}) {what}; log {self.log_path}:{self._log_tail()}")

    def call(self, msg: dict, timeout_s: float, heartbeats: bool = False) -> dict:
        """Send ``msg``, return the answer. Without an answer (or, with ``heartbeats``, a heartbeat) for
        ``timeout_s`` the engine is hung; if the process ends it died: either way it is killed and EngineError
        names it."""
        self.send(msg)
        return self.receive(msg, timeout_s, heartbeats)

    def send(self, msg: dict) -> None:
        """Send ``msg`` without waiting for its answer (``receive`` takes it later: the server answers one message
        at a time, so nothing else may be sent in between)."""
        if self.proc.poll() is not None:
            raise self.fail(f"is not running ({self._exit_text()})")
        try:
            self.conn.send(msg)
        except OSError as e:
            raise self.fail(f"could not be sent {msg['op']!r} ({e})") from e

    def receive(self, msg: dict, timeout_s: float, heartbeats: bool = False) -> dict:
        """The answer to ``msg`` (already sent); heartbeats that queued up meanwhile are read and dropped. The hang
        deadline counts from this call, or from the latest heartbeat."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.conn.poll(POLL_S):
                try:
                    reply = self.conn.recv()
                except (EOFError, OSError):  # the socket closed: the process is ending
                    try:
                        self.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    raise self.fail(f"died during {msg['op']!r} ({self._exit_text()})")
                if "heartbeat" in reply:
                    deadline = time.monotonic() + timeout_s
                    continue
                if not reply.get("ok"):  # an engine that failed is not reused: killed with its children
                    self.kill()
                    raise EngineError(f"{self.name} (pid {self.pid}) failed in {msg['op']!r}: {reply.get('error')}"
                                      f"\n{reply.get('traceback', '')}")
                return reply
            if self.proc.poll() is not None:
                raise self.fail(f"died during {msg['op']!r} ({self._exit_text()})")
            if time.monotonic() > deadline:
                raise self.fail(f"hung: no answer to {msg['op']!r} for {timeout_s:.0f} s"
                                f"{' (no engine step finished)' if heartbeats else ''}; killed")

    def kill(self) -> None:
        """End the process and its group (idempotent)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            self.conn.close()
        except OSError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send({"op": "exit"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _shared_base_dir(engine_cfg) -> str:
    """One directory for the whole actor, agreed by every rank (rank 0 names it)."""
    name = [None]
    if parallel.world_rank() == 0:
        root = engine_cfg.weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        os.makedirs(root, exist_ok=True)
        name[0] = tempfile.mkdtemp(prefix="megatron_ppo-vllm-", dir=root)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes of this rank's GPU; None without one."""
    return tuple(torch.cuda.mem_get_info()) if torch.cuda.is_available() else None


def _all_ranks(value) -> list:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class VllmEngine:
    """``RolloutEngine`` backed by vLLM processes: one per node an actor DP replica spans, over the replica's GPUs on
    that node (rollout/vllm_layout.py), each owned by a first-TP rank on that node."""

    def __init__(self, worker, cfg):
        from megatron_ppo.models.unwrap import unwrap_model

        self.worker, self.cfg, self.engine_cfg = worker, cfg, cfg.rollout.vllm
        self.arch = unwrap_model(worker.model).arch
        head_dim = self.arch.kv_channels or self.arch.hidden_size // self.arch.num_attention_heads
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu and head_dim not in CPU_HEAD_DIMS:
            raise UsageError(f"rollout.name=vllm on CPU: vLLM's CPU attention takes head dims {CPU_HEAD_DIMS}; the "
                             f"actor's is {head_dim} (hidden_size / num_attention_heads, or kv_channels)")
        self.options = engine_options(cfg, self.on_gpu)
        self.base_dir = _shared_base_dir(self.engine_cfg)
        self.dp = parallel.dp_rank()
        self.directory = os.path.join(self.base_dir, f"dp{self.dp:03d}")
        self.representative = parallel.tp_rank() == 0 and parallel.is_last_stage()  # the driver keeps its answer
        self.stage_writer = parallel.tp_rank() == 0
        self.replica: list = []  # this replica's engines (EnginePlacement), set at the start
        self.engine = None  # the EnginePlacement this rank owns, if any
        self.name = f"vLLM engine of actor replica dp{self.dp}"
        self.version = None  # the weights version this replica's engines hold (the same on every rank)
        self.process: EngineProcess | None = None
        self.asleep = False
        self.pending = None  # (the generate message on an owner, else None; its SamplingParams) until collected
        self.export_seconds = self.load_seconds = 0.0
        self.peak_bucket_bytes = 0

    @property
    def owner(self) -> bool:
        return self.engine is not None

    # -------------------------------------------------------------------------------------------- weights
    def _stages(self, mine: list) -> list:
        """The stage writers' lists, concatenated over the pipeline (tp0 ranks; others keep theirs, empty)."""
        if parallel.pp_size() == 1 or not self.stage_writer:
            return mine
        from megatron.core import parallel_state

        gathered = [None] * parallel.pp_size()
        dist.all_gather_object(gathered, mine, group=parallel_state.get_pipeline_model_parallel_group())
        return [item for stage in gathered for item in stage]

    def _export(self, version: int) -> list[str]:
        """Every rank: this replica's weights of ``version`` into its directory; returns (on the first TP ranks)
        all stages' files."""
        start = time.perf_counter()
        files = self._stages(write_weights(self.worker.module, self.directory, version, per_replica=True,
                                           bucket_bytes=int(self.engine_cfg.bucket_mb) << 20))
        self.export_seconds = time.perf_counter() - start
        return files

    def _hand_over(self, version: int) -> None:
        """Every rank: the weights of ``version`` to the running engines, by file or bucket by bucket in memory
        (rollout.vllm.weight_transport)."""
        if self.owner and self.asleep:
            self._call({"op": "wake_up", "tags": ["weights"]}, self.engine_cfg.start_timeout_s)  # KV cache stays freed
        if self.engine_cfg.weight_transport == "file":
            files = self._export(version)
            if self.owner:
                start = time.perf_counter()
                finish_sync(self.directory, version, files, self.arch)
                self._call({"op": "load", "directory": self.directory, "version": version},
                           self.engine_cfg.start_timeout_s)
                self.load_seconds = time.perf_counter() - start
        else:
            self._hand_over_buckets(version)
        if self.owner and self.asleep:
            self._call({"op": "wake_up", "tags": ["kv_cache"]}, self.engine_cfg.start_timeout_s)
            self.asleep = False

    def _hand_over_buckets(self, version: int) -> None:
        """weight_transport=ipc: the replica's stages relay their buckets to every engine owner, which hands each
        to its engine's workers and waits until they have loaded it (weight_buckets.relay_buckets)."""
        start = time.perf_counter()
        if self.stage_writer and os.path.isdir(self.directory):  # the files the engines started from: loaded long ago
            remove_stage_files(self.directory, parallel.pp_rank())
        channel, msg = None, None
        if self.owner:
            workers = self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size  # one per engine GPU
            channel = BucketChannel(self.directory, workers, self.process, self.engine_cfg.start_timeout_s)
            msg = {"op": "load_buckets", "address": channel.address, "authkey": channel.authkey, "version": version,
                   "tie": bool(self.arch.tie_word_embeddings)}
            self._send(msg)
        try:
            got = relay_buckets(self.worker.module, int(self.engine_cfg.bucket_mb) << 20,
                                [e.owner for e in self.replica], channel.send if channel else None)
            if channel is not None:
                check_complete(got["names"], self.arch, version, "weight buckets")
                channel.finish()
                self._receive(msg, self.engine_cfg.start_timeout_s)
                self.peak_bucket_bytes = got["peak_bucket_bytes"]
        except BaseException:
            if channel is not None:
                channel.close()
                if self.process is not None:
                    self.process.kill()
                shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.export_seconds, self.load_seconds = time.perf_counter() - start, 0.0

    def _place(self) -> None:
        """Every rank: where this actor's engines run (a collective: every rank reports its node and GPUs)."""
        e = self.engine_cfg
        placements = plan_engines(gather_rank_devices(), e.tensor_model_parallel_size, e.pipeline_model_parallel_size)
        self.replica = [p for p in placements if p.dp == self.dp]
        self.engine = engine_for_rank(placements, parallel.world_rank())
        memory = _all_ranks(_gpu_memory())  # every rank's (free, total) before the engines take theirs
        if self.engine is not None and self.on_gpu:
            mine = [memory[r] for r in self.engine.ranks if memory[r] is not None]
            self.gpu_memory = (min(f for f, _ in mine), min(t for _, t in mine))
        if self.engine is not None:
            self.name = (f"vLLM engine {self.engine.index} of actor replica dp{self.dp}" if self.engine.count > 1
                         else f"vLLM engine of actor replica dp{self.dp}")
            atexit.register(self.close)

    def _memory_fraction(self, dtype: str) -> float:
        """rollout.vllm.gpu_memory_utilization, lowered to what is free on the engine's GPUs now."""
        gpus = self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size
        element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        weights = sum(p.numel() for p in self.worker.model.parameters()) * element
        weights *= parallel.tp_size() * parallel.pp_size()  # this rank holds 1 / (TP x PP) of them
        free, total = self.gpu_memory
        return memory_fraction(free, total, self.engine_cfg.gpu_memory_utilization, weights // gpus,
                               kv_bytes_per_token(self.arch, element) * self.max_model_len() // gpus, 1 << 30,
                               f"{self.engine.index} of actor replica dp{self.dp}")

    def _start(self, version: int) -> None:
        """Every rank: place the engines, export ``version``; each owner starts its engine on it."""
        self._place()
        files = self._export(version)
        self.version = version
        if not self.owner:
            return
        arch = self.arch
        finish_sync(self.directory, version, files, arch)
        dtype = str(next(self.worker.model.parameters()).dtype).replace("torch.", "")
        write_hf_config(self.directory, arch, dtype)
        e, o = self.engine_cfg, self.options
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(SERVER_DIR),
                   VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # Ray sets them per actor; vLLM binds its own threads
            env.pop(key, None)
        if e.cpu_threads_bind is not None and not self.on_gpu:
            env["VLLM_CPU_OMP_THREADS_BIND"] = e.cpu_threads_bind  # one thread per listed core
        env = engine_env(self.engine, env)
        util = self._memory_fraction(dtype) if self.on_gpu else None
        start = time.perf_counter()
        self.process = EngineProcess(vllm_python(e), self.name, self.log_path(), env, e.start_timeout_s,
                                     e.hang_timeout_s)
        self._call({"op": "start", "model_dir": self.directory, "dtype": dtype, "version": version,
                    "seed": self.cfg.trainer.seed + 1000 * self.dp + self.engine.index,
                    "tensor_parallel_size": self.engine.tensor_parallel_size,
                    "pipeline_parallel_size": self.engine.pipeline_parallel_size,
                    "enforce_eager": o.enforce_eager, "enable_prefix_caching": o.enable_prefix_caching,
                    "enable_sleep_mode": o.sleep_level is not None, "seed_per_request": o.seed_per_request,
                    "max_model_len": self.max_model_len(), "max_num_seqs": e.max_num_seqs,
                    "logprobs_mode": logprobs_mode(self.cfg), "gpu_memory_utilization": util,
                    "kv_cache_memory_bytes": None if self.on_gpu else int(e.cpu_kv_cache_gib * (1 << 30)),
                    "cpu": not self.on_gpu},
                   e.start_timeout_s)
        self.load_seconds = time.perf_counter() - start
        log.info("%s started (pid %d) on weights v%d in %.1f s (GPUs %s)", self.name, self.process.pid, version,
                 self.load_seconds, self.engine.cuda_visible_devices or "none")

    def log_path(self) -> str:
        """The engine's own output: trainer.log_dir/vllm-engine-dp<d>[-<i>].log (the weight directory is removed)."""
        t = self.cfg.trainer
        directory = t.expand(t.log_dir) if t.log_dir else self.base_dir
        os.makedirs(directory, exist_ok=True)
        suffix = f"-{self.engine.index}" if self.engine is not None and self.engine.count > 1 else ""
        return os.path.join(directory, f"vllm-engine-dp{self.dp}{suffix}.log")

    def max_model_len(self) -> int:
        d = self.cfg.data
        return min(d.max_prompt_length + d.max_response_length, self.arch.max_position_embeddings)

    def sync_weights(self) -> None:
        """Every rank: export the actor's current weights and have the engines load them (starts them if they
        are not running yet)."""
        version = self.worker.weights_version
        if self.pending is not None:
            raise EngineError(f"{self.name}: weights v{version} cannot be loaded while a rollout is in flight "
                              "(collect it first: the engine answers one message at a time)")
        if self.version is None:
            self._start(version)
            return
        self._hand_over(version)
        self.version = version

    # -------------------------------------------------------------------------------------------- generate
    def generate(self, prompt_ids: Sequence[torch.Tensor], params: SamplingParams) -> GenerationOutput | None:
        """The replica's responses (on its representative; None on the other ranks, whose answer the driver
        drops)."""
        self.submit(prompt_ids, params)
        return self.collect()

    def submit(self, prompt_ids: Sequence[torch.Tensor], params: SamplingParams) -> None:
        """Every rank: start generating the replica's responses with the weights the actor holds now, and return
        at once (trainer.async_rollout=one_step: the actor trains while the engine generates); ``collect`` takes
        them. Each engine of the replica takes its contiguous share of the prompts. The engines must hold the
        actor's current weights (StaleWeightsError otherwise): staleness comes only from training while a rollout
        is in flight."""
        if self.pending is not None:
            raise EngineError(f"{self.name}: a rollout is in flight already (submitted, not collected)")
        if self.version is None:
            self._start(self.worker.weights_version)  # the first rollout: the engines start on the current weights
        if self.version != self.worker.weights_version:
            raise StaleWeightsError(f"{self.name}: holds weights v{self.version}, the actor is at "
                                    f"v{self.worker.weights_version} (sync_weights was not called after an update)")
        self.pending = (None, params)
        if self.owner:
            if self.asleep:
                self._call({"op": "wake_up", "tags": None}, self.engine_cfg.start_timeout_s)
                self.asleep = False
            rows = rows_of(len(prompt_ids), self.engine.index, self.engine.count)
            self.process.calls += 1
            sampling = {"greedy": params.greedy, "temperature": params.temperature, "top_k": params.top_k,
                        "top_p": params.top_p, "max_tokens": params.max_response_length,
                        "eos_token_ids": list(params.eos_token_ids),
                        "seed": None if params.seed is None else params.seed + rows.start}
            msg = {"op": "generate", "call": self.process.calls, "version": self.version,
                   "prompts": [p.tolist() for p in prompt_ids[rows]], "sampling": sampling,
                   "heartbeat_s": min(5.0, self.engine_cfg.hang_timeout_s / 3)}
            self._send(msg)
            self.pending = (msg, params)

    def collect(self) -> GenerationOutput | None:
        """The submitted rollout's responses (on the representative; None on the other ranks); each engine sleeps
        once its share is collected (rollout.vllm.free_cache_engine, on a GPU)."""
        if self.pending is None:
            raise EngineError(f"{self.name}: nothing to collect (no rollout was submitted)")
        (msg, params), self.pending = self.pending, None
        results = None
        if msg is not None:
            results = self._receive(msg, self.engine_cfg.hang_timeout_s, heartbeats=True)["results"]
            if self.options.sleep_level is not None:
                self._call({"op": "sleep", "level": self.options.sleep_level}, self.engine_cfg.start_timeout_s)
                self.asleep = True
        if len(self.replica) > 1:  # the representative takes every engine's share, in engine order
            results = self._gather_shares(results)
        return to_output(results, params) if self.representative else None

    def _gather_shares(self, results: list | None) -> list | None:
        from megatron.core import parallel_state

        group = parallel_state.get_model_parallel_group()
        shares = [None] * dist.get_world_size(group) if self.representative else None
        rep = RankLayout.for_world(parallel.tp_size(), parallel.pp_size(), parallel.world_size()).representative(
            self.dp)
        dist.gather_object((self.engine.index if self.owner else None, results), shares, dst=rep, group=group)
        return merge_shares(shares) if self.representative else None

    def _send(self, msg: dict) -> None:
        try:
            self.process.send(msg)
        except EngineError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def _receive(self, msg: dict, timeout_s: float, heartbeats: bool = False) -> dict:
        try:
            return self.process.receive(msg, timeout_s, heartbeats)
        except EngineError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def _call(self, msg: dict, timeout_s: float, heartbeats: bool = False) -> dict:
        """A call to the engine; a failed engine is gone (EngineProcess killed it): its weight directory too."""
        self._send(msg)
        return self._receive(msg, timeout_s, heartbeats)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None
        if self.owner:
            shutil.rmtree(self.directory, ignore_errors=True)
            try:
                os.rmdir(self.base_dir)  # the last replica's owner removes the shared directory
            except OSError:
                pass


def merge_shares(shares: list[tuple[int | None, list | None]]) -> list:
    """The replica's answers in prompt order from every rank's (engine index or None, its engine's answers):
    engine i answered rows ``rows_of(n, i, count)``, contiguous and in engine order."""
    owned = sorted((index, share) for index, share in shares if index is not None)
    if [index for index, _ in owned] != list(range(len(owned))):
        raise EngineError(f"answers from engines {[index for index, _ in owned]}, expected 0..{len(owned) - 1}")
    return [row for _, share in owned for row in share]


def to_output(results: list[dict], params: SamplingParams) -> GenerationOutput:
    """The engine's per-request answers as the Megatron engine returns them: responses padded with pad_token_id
    after the end, eos included in the length, log-probs 0 after the end."""
    width = max((len(r["token_ids"]) for r in results), default=0) or 1
    b = len(results)
    responses = torch.full((b, width), params.pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((b, width), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    finished = torch.zeros(b, dtype=torch.bool)
    eos = set(params.eos_token_ids)
    for i, r in enumerate(results):
        ids = r["token_ids"]
        if len(ids) > params.max_response_length or len(r["log_probs"]) != len(ids):
            raise EngineError(f"vLLM answer {i}: {len(ids)} tokens, {len(r['log_probs'])} log-probs, max "
                              f"{params.max_response_length}")
        responses[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[i, :len(ids)] = torch.tensor(r["log_probs"], dtype=torch.float32)
        lengths[i] = len(ids)
        finished[i] = bool(ids) and ids[-1] in eos
    return GenerationOutput(responses=responses, response_lengths=lengths, log_probs=log_probs, finished=finished)


def build_engine(worker, cfg) -> VllmEngine:
    return VllmEngine(worker, cfg)

