"""LocalWorkerPool fails fast when a rank dies: while starting (a real rendezvous failure: rank 0 cannot listen on a
port that is taken) and while running a job (os._exit, a real segfault), naming the rank, its exit code or signal
and the traceback it sent; the other ranks (blocked in C++ rendezvous / collectives) and their children are gone
afterwards; the next job starts a fresh pool."""
from __future__ import annotations

import os
import socket
import threading
import time

import psutil
import pytest

from megatron_ppo.parallel.launch import LocalWorkerPool

# the module is imported by the spawned ranks too (job functions are pickled by reference)

pytestmark = pytest.mark.slow

BIG_TIMEOUT = 300.0  # start and job timeouts stay large: the failure must not wait for them
FAST = 10.0  # seconds from the rank's death to the error


def _other_processes() -> set[int]:
    """Our descendants, after making sure multiprocessing's resource tracker (which outlives pools) is one."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_nothing_left(before: set[int]):
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"orphaned processes: {[(p.pid, p.cmdline()) for p in left]}"


class _DeathWatch(threading.Thread):
    """Notes (every 20 ms) when each process we spawned stops running: the time a rank died, from outside it."""

    def __init__(self, ignore: set[int]):
        super().__init__(daemon=True)
        self.ignore, self.seen, self.died, self.stop = ignore, {}, {}, threading.Event()

    def run(self):
        while not self.stop.is_set():
            for p in psutil.Process().children():
                if p.pid not in self.ignore:
                    self.seen.setdefault(p.pid, p)
            for pid, p in self.seen.items():
                if pid not in self.died:
                    try:
                        gone = p.status() == psutil.STATUS_ZOMBIE
                    except psutil.NoSuchProcess:
                        gone = True
                    if gone:
                        self.died[pid] = time.monotonic()
            time.sleep(0.02)


def _die_in_rank_1(rank, world, how, stamp_path):
    """Rank 1 starts a child process, then dies the way ``how`` says; rank 0 keeps working, as if in a long computation or in a collective that
    does not notice a dead peer (gloo's barrier would notice, and then rank 0's error alone fails the old pool)."""
    if rank == 1:
        import subprocess

        child = subprocess.Popen(["sleep", str(BIG_TIMEOUT)])  # outlives its rank unless the pool ends it
        with open(stamp_path + ".child", "w") as f:
            f.write(str(child.pid))
        time.sleep(1.0)  # the pool notes the ranks' children while it waits
        with open(stamp_path, "w") as f:
            f.write(repr(time.time()))
        if how == "exit":
            os._exit(7)
        import ctypes

        ctypes.string_at(0)  # a real segfault: read address 0
    time.sleep(BIG_TIMEOUT)
    return "unreachable"


def _ranks(rank, world):
    return (rank, world, os.getpid())


def test_rank_dying_during_setup_fails_the_start_fast_and_leaves_no_process():
    before = _other_processes()
    watch = _DeathWatch(ignore=before)
    watch.start()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # rank 0's rendezvous store cannot listen here; rank 1 connects and waits for an answer
        pool = LocalWorkerPool(2, start_timeout=BIG_TIMEOUT, port=taken.getsockname()[1])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            pool.run(_ranks)
        t_error = time.monotonic()
    watch.stop.set()
    watch.join()
    msg = str(e.value)
    assert "rank 0 (pid" in msg and "died while starting (exit code 1)" in msg, msg
    assert "rank 1" not in msg, msg  # rank 1 was only waiting for rank 0 (and was killed by the pool)
    assert "--- rank 0 ---" in msg and "Traceback" in msg and "EADDRINUSE" in msg, msg
    rank0 = int(msg.split("rank 0 (pid ")[1].split(")")[0])
    latency = t_error - watch.died[rank0]
    print(f"\nsetup failure: error {latency:.2f} s after rank 0 died ({t_error - t0:.1f} s after the start, "
          "spawn and imports included)")
    assert latency < FAST, f"{latency:.1f} s: the start waited instead of noticing the dead rank"
    _assert_nothing_left(before)


@pytest.mark.parametrize("how, code_text", [("exit", "(exit code 7)"), ("segfault", "(killed by SIGSEGV, exit code -11)")])
def test_rank_dying_during_a_job_fails_it_fast_and_the_next_job_gets_a_fresh_pool(tmp_path, how, code_text):
    before = _other_processes()
    stamp = str(tmp_path / "died_at")
    with LocalWorkerPool(2, start_timeout=BIG_TIMEOUT) as pool:
        first = pool.run(_ranks)
        with pytest.raises(RuntimeError) as e:
            pool.run(_die_in_rank_1, how, stamp, timeout=BIG_TIMEOUT)
        latency = time.time() - float(open(stamp).read())
        msg = str(e.value)
        print(f"\n{how}: error {latency:.2f} s after rank 1 died")
        assert f"rank 1 (pid {first[1][2]}) died while running _die_in_rank_1 {code_text}" in msg, msg
        assert "rank 0" not in msg, msg  # rank 0 did nothing wrong: it was only waiting
        assert latency < FAST
        orphan = int(open(stamp + ".child").read())  # re-parented when rank 1 died: not our descendant any more
        for pid in [pid for _, _, pid in first] + [orphan]:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        again = pool.run(_ranks)
        assert [r[:2] for r in again] == [(0, 2), (1, 2)] and {r[2] for r in again}.isdisjoint(r[2] for r in first)
    _assert_nothing_left(before)


def test_a_proposed_port_taken_before_rank_0_listens_is_retried(monkeypatch, caplog):
    """free_port() only proposes a port; here the first proposal is taken (as by another process while the ranks
    import), so rank 0 really fails with EADDRINUSE and the pool starts again on the next proposal."""
    from megatron_ppo.parallel import launch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proposals = [taken.getsockname()[1]]
        monkeypatch.setattr(launch, "free_port", lambda: proposals.pop() if proposals else _free())
        with LocalWorkerPool(2, start_timeout=BIG_TIMEOUT) as pool:
            assert [r[:2] for r in pool.run(_ranks)] == [(0, 2), (1, 2)]
    assert "rendezvous port taken" in caplog.text


def _free() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
