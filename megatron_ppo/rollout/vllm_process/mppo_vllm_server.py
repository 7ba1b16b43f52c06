"""The vLLM engine process of one actor DP replica. Runs in the vLLM virtualenv (make setup-vllm), started by
megatron_ppo/rollout/vllm.py; it imports nothing of megatron_ppo (that venv has none of it).

    <vllm-venv>/bin/python mppo_vllm_server.py <fd>

``fd`` is this end of a socketpair with the actor rank that started it. Messages are pickled dicts
(multiprocessing.connection): {"op": "start" | "load" | "load_buckets" | "sleep" | "wake_up" |
"generate" | "ping" | "exit", ...} -> {"ok": True, ...} or
{"ok": False, "error": "..."}; while generating it sends {"heartbeat": tokens_so_far} after every engine step that
ends more than ``heartbeat_s`` after the last, so the rank can tell a hung engine from a long rollout.

The process ends when the rank asks, when the socket closes (the rank died) or when its parent changes (ditto).
Weights arrive by file (the versioned directory rollout/weights.py writes: safetensors + sync.json; the version
asked for is checked against the manifest) or in buckets from the owner rank (``load_buckets``: each vLLM worker
connects to the owner's socket and receives one bucket at a time as a CUDA IPC handle on a GPU, a shared-memory
name on the CPU; rollout.vllm.weight_transport=ipc). Either way they are loaded in place
(``reload_weights`` with an iterator: vLLM re-runs its post-load processing, e.g. the CPU's oneDNN repacking) and
a tied lm_head is re-tied and re-processed (without it the head keeps the old embedding's packed weights).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

MANIFEST = "sync.json"


class WeightSync:
    """vLLM worker extension (``worker_extension_cls``): methods called on every vLLM worker by collective_rpc."""

    def mppo_load(self, directory: str, version: int) -> int:
        from safetensors import safe_open

        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
        if manifest["version"] != version:
            raise RuntimeError(f"{directory} holds weights of sync version {manifest['version']}, asked for {version}")

        def tensors():
            for name in manifest["files"]:
                with safe_open(os.path.join(directory, name), "pt") as f:
                    for key in f.keys():
                        yield key, f.get_tensor(key)

        self.reload_weights(weights_iterator=tensors())
        self._retie(bool(manifest.get("tie_word_embeddings")))
        self.mppo_version = version
        return version

    def mppo_receive(self, address: str, authkey: bytes, version: int, tie_word_embeddings: bool) -> int:
        """The same load, bucket by bucket from the owner rank (rollout.vllm.weight_transport=ipc): each bucket
        arrives as a handle to one flat buffer (CUDA IPC on a GPU, shared memory on the CPU) and its layout; its
        tensors go to vLLM's loader, then the owner is told, and only then sends the next bucket."""
        import torch
        import torch.multiprocessing as mp
        from multiprocessing.connection import Client

        mp.set_sharing_strategy("file_system")
        conn = Client(address, family="AF_UNIX", authkey=authkey)

        def tensors():
            while True:
                msg = conn.recv()
                if msg is None:
                    return
                fn, args = msg["handle"]
                if msg.get("device_uuid"):
                    args = _on_local_device(args, msg["device_uuid"])
                flat = fn(*args)
                for name, shape, dtype, offset, n in zip(msg["names"], msg["shapes"], msg["dtypes"],
                                                         msg["offsets"], msg["nbytes"]):
                    yield name, flat[offset:offset + n].view(getattr(torch, dtype)).view(shape)
                del flat
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # the copies out of the owner's buffer are done
                conn.send("ack")

        try:
            self.reload_weights(weights_iterator=tensors())
        finally:
            conn.close()
        self._retie(tie_word_embeddings)
        self.mppo_version = version
        return version

    def _retie(self, tied: bool) -> None:
        if tied:
            model = self.model_runner.get_model()
            head, embed = model.lm_head, model.model.embed_tokens
            head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)  # CPU: the packed GEMM handle of the new weight

    def mppo_version_loaded(self) -> int:
        return getattr(self, "mppo_version", -1)


OWNED_DIR: list[str] = []  # the replica's weight directory: removed when this process ends, however it ends


def _on_local_device(args: tuple, uuid: str) -> tuple:
    """A CUDA IPC handle's rebuild arguments with the device index of the GPU ``uuid`` as this process numbers it
    (the sender's index is its own: each Ray actor sees its GPU as device 0). verl remaps the same way."""
    import torch

    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return (*args[:6], index, *args[7:])  # rebuild_cuda_tensor's storage_device
    raise RuntimeError(f"weight hand-over: GPU {uuid} holds the bucket but this vLLM worker cannot see it "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")


def _remove_owned() -> None:
    import shutil

    for directory in OWNED_DIR:
        shutil.rmtree(directory, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(directory))  # the actor's shared directory, once the last replica's is gone
        except OSError:
            pass


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            _remove_owned()
            os._exit(3)
        time.sleep(1.0)


class Server:
    def __init__(self, conn):
        self.conn = conn
        self.llm = None
        self.version = -1
        self.seed_per_request = True
        self.asleep = False

    def start(self, msg: dict) -> dict:
        from vllm import LLM

        kwargs = dict(model=msg["model_dir"], skip_tokenizer_init=True, dtype=msg["dtype"], seed=msg["seed"],
                      tensor_parallel_size=msg["tensor_parallel_size"],
                      pipeline_parallel_size=msg.get("pipeline_parallel_size", 1), enforce_eager=msg["enforce_eager"],
                      max_model_len=msg["max_model_len"], max_num_seqs=msg["max_num_seqs"],
                      logprobs_mode=msg["logprobs_mode"], worker_extension_cls="mppo_vllm_server.WeightSync",
                      disable_log_stats=True, enable_prefix_caching=msg.get("enable_prefix_caching", False))
        if msg.get("enable_sleep_mode"):
            kwargs["enable_sleep_mode"] = True
        self.seed_per_request = msg.get("seed_per_request", True)
        if msg.get("gpu_memory_utilization") is not None:
            kwargs["gpu_memory_utilization"] = msg["gpu_memory_utilization"]
        if msg.get("kv_cache_memory_bytes"):
            kwargs["kv_cache_memory_bytes"] = msg["kv_cache_memory_bytes"]
        if msg.get("cpu"):
            # Every request is seeded. A chunked prefill drops the step's sample and rewinds the request's
            # generator, which a CPU generator refuses ("CPU Generator does not use offset"): on CPU whole prompts
            # only, as many as fit a step's token budget.
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(msg["max_model_len"], 4096))
        OWNED_DIR.append(msg["model_dir"])
        self.llm = LLM(**kwargs)
        self.version = msg["version"]  # the model directory holds this version (config.json + its safetensors)
        return {"version": self.version}

    def load(self, msg: dict) -> dict:
        got = self.llm.collective_rpc("mppo_load", args=(msg["directory"], msg["version"]))
        if set(got) != {msg["version"]}:
            raise RuntimeError(f"vLLM workers loaded versions {got}, asked for {msg['version']}")
        self.version = msg["version"]
        return {"version": self.version}

    def load_buckets(self, msg: dict) -> dict:
        got = self.llm.collective_rpc("mppo_receive", args=(msg["address"], msg["authkey"], msg["version"],
                                                            msg["tie"]))
        if set(got) != {msg["version"]}:
            raise RuntimeError(f"vLLM workers loaded versions {got}, asked for {msg['version']}")
        self.version = msg["version"]
        return {"version": self.version}

    def sleep(self, msg: dict) -> dict:
        """vLLM's sleep mode: level 1 moves the weights to host memory and frees the KV cache."""
        self.llm.sleep(level=msg["level"])
        self.asleep = True
        return {"asleep": True}

    def wake_up(self, msg: dict) -> dict:
        """Back on the GPU: ``tags`` ["weights"] before a load (the KV cache stays freed while the weights load),
        then ["kv_cache"]; None: everything."""
        self.llm.wake_up(tags=msg.get("tags"))
        self.asleep = msg.get("tags") == ["weights"]
        return {"asleep": self.asleep}

    def generate(self, msg: dict) -> dict:
        if self.asleep:
            raise RuntimeError("the engine is asleep (sleep mode): wake_up before generating")
        if msg["version"] != self.version:
            raise RuntimeError(f"stale weights: the engine holds sync version {self.version}, the actor is at "
                               f"{msg['version']}")
        from vllm import SamplingParams

        s = msg["sampling"]
        engine = self.llm.llm_engine
        ids = []
        for i, prompt in enumerate(msg["prompts"]):
            params = SamplingParams(
                n=1, temperature=0.0 if s["greedy"] else s["temperature"], top_k=s["top_k"] if s["top_k"] > 0 else 0,
                top_p=s["top_p"], max_tokens=s["max_tokens"], min_tokens=0, ignore_eos=True,
                stop_token_ids=list(s["eos_token_ids"]), logprobs=0, detokenize=False,
                seed=None if s.get("seed") is None or not self.seed_per_request else s["seed"] + i)
            request_id = f"r{msg['call']}-{i}"
            engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
            ids.append(request_id)
        done, last, tokens = {}, time.monotonic(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
            tokens += 1
            if time.monotonic() - last > msg["heartbeat_s"]:
                self.conn.send({"heartbeat": tokens})
                last = time.monotonic()
        results = []
        for request_id in ids:
            c = done[request_id]
            lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                   for t, d in zip(c.token_ids, c.logprobs)]
            results.append({"token_ids": list(c.token_ids), "log_probs": lps, "finish_reason": c.finish_reason})
        return {"results": results}

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return  # the rank is gone
            op = msg.get("op")
            if op == "exit":
                self.conn.send({"ok": True})
                return
            try:
                if op == "ping":
                    reply = {"version": self.version, "pid": os.getpid()}
                elif op == "start":
                    reply = self.start(msg)
                elif op == "load":
                    reply = self.load(msg)
                elif op == "load_buckets":
                    reply = self.load_buckets(msg)
                elif op == "sleep":
                    reply = self.sleep(msg)
                elif op == "wake_up":
                    reply = self.wake_up(msg)
                elif op == "generate":
                    reply = self.generate(msg)
                else:
                    raise ValueError(f"unknown op {op!r}")
                self.conn.send({"ok": True, **reply})
            except Exception as e:  # reported to the rank, which raises it naming the replica
                self.conn.send({"ok": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()[-4000:]})


def cores(spec: str) -> set[int]:
    """'0,2-3' -> {0, 2, 3}"""
    out = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def main() -> None:
    from multiprocessing.connection import Connection

    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") not in ("auto", "nobind", "all"):
        # rollout.vllm.cpu_threads_bind: vLLM binds its OMP threads there; the rest of the process (the engine loop,
        # this server, tokenisation) would stay on the parent's cores, the training's: all of it goes there
        os.sched_setaffinity(0, cores(os.environ["VLLM_CPU_OMP_THREADS_BIND"]))
    conn = Connection(int(sys.argv[1]))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        Server(conn).serve()
    finally:
        _remove_owned()
        os._exit(0)  # vLLM's threads must not keep the process alive


if __name__ == "__main__":
    main()
