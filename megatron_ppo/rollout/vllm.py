"""The vLLM rollout engine (``rollout.name=vllm``): one vLLM process per actor DP replica, in its own virtualenv
(``make setup-vllm``: vLLM pins a transformers that verl, our test oracle, refuses), weights synced by file from
the actor after every update.

Why managed subprocesses, not Ray actors: the actor's ranks run on Ray or on torchrun (launcher=local), and a Ray
actor with another Python needs Ray of the same version inside the vLLM venv; a child process of the replica's
representative rank (tp0, last pipeline stage: the rank whose answer the driver keeps) needs only the venv's
Python, sits on that rank's node (where its GPU and /dev/shm are), and dies with it (the socket closes, its parent
changes). docs/rollout.md, "The vLLM engine".

Each step: the actor updates (its ``weights_version`` grows), then ``sync_weights`` on every actor rank: the TP
shards are gathered under HF names by the converter's mapping (rollout/weights.py) and handed over
(rollout.vllm.weight_transport): ``file``, safetensors buckets in one directory per DP replica (the replica's tp0
ranks agree on the files over the pipeline group; the representative writes the manifest and asks its engine to
load that version), or ``ipc``, tensors shared with the engine process (CUDA IPC on a GPU, shared memory on the
CPU), loaded before the stages free them. The engine starts from files either way. ``generate`` refuses an engine whose version is not the
actor's (``StaleWeightsError``): an engine never generates with an old policy.
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
from megatron_ppo.errors import UsageError
from megatron_ppo.rollout.base import GenerationOutput, SamplingParams
from megatron_ppo.rollout.weights import (StaleWeightsError, check_complete, finish_sync, share_weights,
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


class VllmEngine:
    """``RolloutEngine`` backed by a vLLM process per DP replica, owned by the replica's representative rank."""

    def __init__(self, worker, cfg):
        from megatron_ppo.models.unwrap import unwrap_model

        self.worker, self.cfg, self.engine_cfg = worker, cfg, cfg.rollout.vllm
        self.arch = unwrap_model(worker.model).arch
        head_dim = self.arch.kv_channels or self.arch.hidden_size // self.arch.num_attention_heads
        if not torch.cuda.is_available() and head_dim not in CPU_HEAD_DIMS:
            raise UsageError(f"rollout.name=vllm on CPU: vLLM's CPU attention takes head dims {CPU_HEAD_DIMS}; the "
                             f"actor's is {head_dim} (hidden_size / num_attention_heads, or kv_channels)")
        self.base_dir = _shared_base_dir(self.engine_cfg)
        self.dp = parallel.dp_rank()
        self.directory = os.path.join(self.base_dir, f"dp{self.dp:03d}")
        self.owner = parallel.tp_rank() == 0 and parallel.is_last_stage()
        self.stage_writer = parallel.tp_rank() == 0
        self.name = f"vLLM engine of actor replica dp{self.dp}"
        self.version = None  # the weights version this replica's engine holds (the same on every rank)
        self.process: EngineProcess | None = None
        self.pending = None  # (the generate message on the owner, else None; its SamplingParams) until collected
        self.export_seconds = self.load_seconds = 0.0
        if self.owner:
            atexit.register(self.close)

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
        """Every rank: this replica's weights of ``version`` into its directory; returns (on the owner) all
        stages' files."""
        start = time.perf_counter()
        files = self._stages(write_weights(self.worker.module, self.directory, version, per_replica=True,
                                           bucket_bytes=int(self.engine_cfg.bucket_mb) << 20))
        self.export_seconds = time.perf_counter() - start
        return files

    def _hand_over(self, version: int) -> None:
        """Every rank: the weights of ``version`` to the running engine, by file or by shared tensors
        (rollout.vllm.weight_transport)."""
        if self.engine_cfg.weight_transport == "file":
            files = self._export(version)
            if self.owner:
                start = time.perf_counter()
                finish_sync(self.directory, version, files, self.arch)
                self._call({"op": "load", "directory": self.directory, "version": version},
                           self.engine_cfg.start_timeout_s)
                self._prune(version)
                self.load_seconds = time.perf_counter() - start
            return
        start = time.perf_counter()
        handles, keep = share_weights(self.worker.module)
        handles = self._stages(handles)
        self.export_seconds = time.perf_counter() - start
        if self.owner:
            start = time.perf_counter()
            check_complete([name for name, _ in handles], self.arch, version, "shared tensors")
            self._call({"op": "load_shared", "version": version, "tensors": handles,
                        "tie": bool(self.arch.tie_word_embeddings)}, self.engine_cfg.start_timeout_s)
            self.load_seconds = time.perf_counter() - start
        if parallel.pp_size() > 1 and self.stage_writer:  # the other stages' tensors live until the engine has them
            from megatron.core import parallel_state

            dist.barrier(group=parallel_state.get_pipeline_model_parallel_group())
        del keep

    def _prune(self, version: int) -> None:
        keep = f"v{version}-"
        for name in os.listdir(self.directory):
            if name.endswith(".safetensors") and not name.startswith(keep):
                os.remove(os.path.join(self.directory, name))

    def _start(self, version: int) -> None:
        """Every rank: export ``version``; the owner starts its engine on it."""
        files = self._export(version)
        self.version = version
        if not self.owner:
            return
        arch = self.arch
        finish_sync(self.directory, version, files, arch)
        dtype = str(next(self.worker.model.parameters()).dtype).replace("torch.", "")
        write_hf_config(self.directory, arch, dtype)
        e = self.engine_cfg
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(SERVER_DIR),
                   VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # Ray sets them per actor; vLLM binds its own threads
            env.pop(key, None)
        if e.cpu_threads_bind is not None and not torch.cuda.is_available():
            env["VLLM_CPU_OMP_THREADS_BIND"] = e.cpu_threads_bind  # one thread per listed core
        start = time.perf_counter()
        self.process = EngineProcess(vllm_python(e), self.name, self.log_path(), env, e.start_timeout_s,
                                     e.hang_timeout_s)
        on_gpu = torch.cuda.is_available()
        self._call({"op": "start", "model_dir": self.directory, "dtype": dtype, "version": version,
                    "seed": self.cfg.trainer.seed, "tensor_parallel_size": e.tensor_model_parallel_size,
                    "enforce_eager": e.enforce_eager, "max_model_len": self.max_model_len(),
                    "max_num_seqs": e.max_num_seqs, "logprobs_mode": logprobs_mode(self.cfg),
                    "gpu_memory_utilization": e.gpu_memory_utilization if on_gpu else None,
                    "kv_cache_memory_bytes": None if on_gpu else int(e.cpu_kv_cache_gib * (1 << 30)),
                    "cpu": not on_gpu},
                   e.start_timeout_s)
        self.load_seconds = time.perf_counter() - start
        log.info("%s started (pid %d) on weights v%d in %.1f s", self.name, self.process.pid, version,
                 self.load_seconds)

    def log_path(self) -> str:
        """The engine's own output: trainer.log_dir/vllm-engine-dp<d>.log (the weight directory is removed)."""
        t = self.cfg.trainer
        directory = t.expand(t.log_dir) if t.log_dir else self.base_dir
        os.makedirs(directory, exist_ok=True)
        return os.path.join(directory, f"vllm-engine-dp{self.dp}.log")

    def max_model_len(self) -> int:
        d = self.cfg.data
        return min(d.max_prompt_length + d.max_response_length, self.arch.max_position_embeddings)

    def sync_weights(self) -> None:
        """Every rank: export the actor's current weights and have the engine load them (starts the engine if it
        is not running yet)."""
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
        """The replica's responses (on its owner; None on the other ranks, whose answer the driver drops)."""
        self.submit(prompt_ids, params)
        return self.collect()

    def submit(self, prompt_ids: Sequence[torch.Tensor], params: SamplingParams) -> None:
        """Every rank: start generating the replica's responses with the weights the actor holds now, and return
        at once (trainer.async_rollout=one_step: the actor trains while the engine generates); ``collect`` takes
        them. The engine must hold the actor's current weights
        (StaleWeightsError otherwise): staleness comes only from training while a rollout is in flight."""
        if self.pending is not None:
            raise EngineError(f"{self.name}: a rollout is in flight already (submitted, not collected)")
        if self.version is None:
            self._start(self.worker.weights_version)  # the first rollout: the engine starts on the current weights
        if self.version != self.worker.weights_version:
            raise StaleWeightsError(f"{self.name}: holds weights v{self.version}, the actor is at "
                                    f"v{self.worker.weights_version} (sync_weights was not called after an update)")
        self.pending = (None, params)
        if self.owner:
            self.process.calls += 1
            sampling = {"greedy": params.greedy, "temperature": params.temperature, "top_k": params.top_k,
                        "top_p": params.top_p, "max_tokens": params.max_response_length,
                        "eos_token_ids": list(params.eos_token_ids), "seed": params.seed}
            msg = {"op": "generate", "call": self.process.calls, "version": self.version,
                   "prompts": [p.tolist() for p in prompt_ids], "sampling": sampling,
                   "heartbeat_s": min(5.0, self.engine_cfg.hang_timeout_s / 3)}
            self._send(msg)
            self.pending = (msg, params)

    def collect(self) -> GenerationOutput | None:
        """The submitted rollout's responses (on the owner; None on the other ranks)."""
        if self.pending is None:
            raise EngineError(f"{self.name}: nothing to collect (no rollout was submitted)")
        (msg, params), self.pending = self.pending, None
        if msg is None:
            return None
        try:
            reply = self.process.receive(msg, self.engine_cfg.hang_timeout_s, heartbeats=True)
        except EngineError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        return to_output(reply["results"], params)

    def _send(self, msg: dict) -> None:
        try:
            self.process.send(msg)
        except EngineError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def _call(self, msg: dict, timeout_s: float, heartbeats: bool = False) -> dict:
        """A call to the engine; a failed engine is gone (EngineProcess killed it): its weight directory too."""
        try:
            return self.process.call(msg, timeout_s, heartbeats)
        except EngineError:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

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

