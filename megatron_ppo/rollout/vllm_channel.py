"""The owner rank's end of a bucketed weight hand-over to its vLLM engine's workers (weight_transport=ipc).

Each of the engine's workers (one per GPU of the engine; one on the CPU) connects to a Unix socket the owner listens
on, inside the replica's private directory, with a per-sync key. For every bucket the owner sends its layout and a
handle (torch.multiprocessing's reduction: CUDA IPC on a GPU, a shared-memory name on the CPU) to every worker and
waits until each has handed the bucket's tensors to vLLM's loader; then the next. A worker that does not answer
within the deadline, an engine process that dies, or one that answers (fails) before the hand-over ends, is an
EngineError naming the engine (the caller kills it).
"""
from __future__ import annotations

import os
import secrets
import threading
import time
from multiprocessing.connection import Connection, Listener

import torch

POLL_S = 0.5


def device_uuid(t: torch.Tensor) -> str | None:
    """The GPU a CUDA tensor lives on, as every process names it (indices differ with CUDA_VISIBLE_DEVICES)."""
    if t.device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(t.device).uuid)


class BucketChannel:
    """Listens at ``<directory>/weights-<pid>.sock`` for ``workers`` connections of the engine ``process``
    (an EngineProcess: ``fail`` names and kills it)."""

    def __init__(self, directory: str, workers: int, process, timeout_s: float):
        self.address = os.path.join(directory, f"weights-{os.getpid()}.sock")
        if len(self.address) > 100:  # AF_UNIX paths are at most 107 bytes
            import tempfile

            self.address = os.path.join(tempfile.gettempdir(), f"mppo-weights-{os.getpid()}.sock")
        if os.path.exists(self.address):
            os.remove(self.address)
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self.workers, self.process, self.timeout_s = workers, process, timeout_s
        self.conns: list[Connection] = []
        self.buckets = 0

    def _alive_or_fail(self, what: str, deadline: float) -> None:
        if self.process.conn.poll(0):  # the engine answered before the hand-over ended: its load failed
            self.close()
            self.process.receive({"op": "load_buckets"}, self.timeout_s)  # raises its error, naming the engine
            raise self.process.fail(f"answered 'load_buckets' before the hand-over ended ({what})")
        if self.process.proc.poll() is not None:
            raise self.process.fail(f"died during the weight hand-over ({what})")
        if time.monotonic() > deadline:
            raise self.process.fail(f"hung: no answer for {self.timeout_s:.0f} s during the weight hand-over "
                                    f"({what}); killed")

    def _accept(self) -> None:
        got: list = []
        errors: list = []

        def accept():
            try:
                while len(got) < self.workers:
                    got.append(self.listener.accept())
            except OSError as e:  # the listener was closed: we gave up
                errors.append(e)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive():
                try:
                    self._alive_or_fail(f"{len(got)} of {self.workers} workers connected", deadline)
                except Exception:
                    self.close()
                    raise
        self.conns = got

    def send(self, flat: torch.Tensor, meta: dict) -> None:
        """Hand one bucket to every worker; returns once each has loaded it."""
        from torch.multiprocessing.reductions import reduce_tensor

        if not self.conns:
            self._accept()
        msg = dict(meta, handle=reduce_tensor(flat), device_uuid=device_uuid(flat))
        for conn in self.conns:
            conn.send(msg)
        self._acks(f"bucket {self.buckets}")
        self.buckets += 1

    def _acks(self, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        waiting = list(self.conns)
        while waiting:
            for conn in list(waiting):
                if conn.poll(POLL_S / max(1, len(waiting))):
                    try:
                        reply = conn.recv()
                    except (EOFError, OSError):
                        raise self.process.fail(f"closed a weight channel during {what}") from None
                    if reply != "ack":
                        raise self.process.fail(f"answered {reply!r} to {what}")
                    waiting.remove(conn)
            if waiting:
                self._alive_or_fail(what, deadline)

    def finish(self) -> None:
        """No more buckets: the workers finish vLLM's reload (a worker that got no bucket still connects)."""
        if not self.conns:
            self._accept()
        for conn in self.conns:
            conn.send(None)
        self.close()

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        try:
            self.listener.close()
        except OSError:
            pass
        if os.path.exists(self.address):
            os.remove(self.address)
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # blocks the engine has released may be reused now
