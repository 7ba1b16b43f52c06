"""Process-tree helpers for tests that send real signals and check that nothing is left running."""
from __future__ import annotations

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (empty when it is already gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def interrupt(proc, sig: int, timeout: float = 60.0) -> tuple[list[psutil.Process], str, str]:
    """Send ``sig`` to ``proc`` alone (as `kill PID` or a Ctrl-C delivered to it would, not to its group) and wait
    for it: (its process tree just before the signal, stdout, stderr). If it outlives the wait, its whole group
    (``start_new_session=True``) is killed."""
    import os
    import signal

    try:
        tree = process_tree(proc.pid)
        os.kill(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return tree, stdout, stderr


def still_alive(tree: list[psutil.Process]) -> list[int]:
    """The pids of ``tree`` still running (zombies count as gone)."""
    out = []
    for p in tree:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def wait_for_line(proc, prefix: str, timeout: float = 600.0) -> None:
    """Read ``proc``'s stdout (text) until a line starts with ``prefix``; AssertionError naming its exit code and
    the end of its stderr if it ends first, or if ``timeout`` passes."""
    import time

    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith(prefix):
            return
        assert time.monotonic() < deadline, f"no line starting {prefix!r} within {timeout:.0f} s"
    raise AssertionError(f"the process ended before a line starting {prefix!r}: exit code {proc.wait()}, "
                         f"stderr {proc.stderr.read()[-3000:]}")
