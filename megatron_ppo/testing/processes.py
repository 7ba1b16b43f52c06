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
    return [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
