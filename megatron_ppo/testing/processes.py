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
