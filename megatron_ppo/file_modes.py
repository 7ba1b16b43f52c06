"""Files we publish get the modes a plain ``open`` / ``mkdir`` would give them under the process's umask.

Why: tempfile's mkstemp / mkdtemp (our atomic writes' temp names) create 0600 files and 0700 directories, and
safetensors writes 0600 files; renamed into place they would stay unreadable to the rest of a cluster's users
and jobs (a shared results directory, an eval job under another account)."""
from __future__ import annotations

import os


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` as the process's umask lets a new file have it."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def publish_tree(root: str) -> None:
    """``root`` and everything under it: directories 0777, files 0666, both less the umask."""
    files, dirs = umask_mode(0o666), umask_mode(0o777)
    os.chmod(root, dirs)
    for parent, subdirs, names in os.walk(root):
        for name in subdirs:
            os.chmod(os.path.join(parent, name), dirs)
        for name in names:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, files)
