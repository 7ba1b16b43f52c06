"""models/heap.py: freed heap pages go back to the OS (what keeps a checkpoint save from stacking on a rank's last
peak; measured on SmolLM2 in docs/bench/learning_smollm2.md). In a fresh process: the test's own mmap threshold
and arenas must not depend on what this pytest process allocated before."""
import os
import subprocess
import sys
import types

import pytest

from megatron_ppo.models import heap

SCRIPT = """
import torch
import psutil
from megatron_ppo.models.heap import release_free_heap
rss_bytes = lambda: psutil.Process().memory_info().rss
torch.set_num_threads(1)
x = torch.ones(5_000_000); del x  # a freed mmap chunk raises glibc's mmap threshold above 20 MB: heap from here on
xs, pins = [], []
for _ in range(25):  # 500 MB in 20 MB tensors, each followed by a small live one: freed, they are holes in the heap,
    xs.append(torch.ones(5_000_000))  # not its top, as a rank's activations are between the tensors it keeps
    pins.append(torch.ones(1000))
del xs
held = rss_bytes()
ok = release_free_heap()
print(held, rss_bytes(), ok)
"""


@pytest.mark.skipif(heap._libc() is None, reason="malloc_trim is glibc's")
def test_freed_heap_is_retained_until_released():
    # glibc's mmap threshold pinned above the 20 MB tensors and automatic trimming off: the freed memory stays in the
    # heap whatever glibc's dynamic threshold makes of this process's earlier allocations (left dynamic, the freed
    # tensors were sometimes mmapped and returned at once: 296-376 MB held instead of 776)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    held, after, ok = int(out[0]), int(out[1]), out[2]
    assert ok == "True"
    assert held - after > 400e6, f"RSS {held / 1e6:.0f} MB -> {after / 1e6:.0f} MB: the 500 MB freed was not released"
SAVE_SCRIPT = """
import sys, torch
from megatron_ppo import parallel
from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.models.checkpoint import save_checkpoint
from megatron_ppo.models.gpt import build_gpt_model
import psutil
rss_bytes = lambda: psutil.Process().memory_info().rss
torch.set_num_threads(1)
parallel.initialize(tp=1, pp=1, seed=1)
model = build_gpt_model(tiny_arch(), role="actor")
x = torch.ones(5_000_000); del x
xs, pins = [], []
for _ in range(25):  # a rank's last peak, freed: holes in the heap
    xs.append(torch.ones(5_000_000))
    pins.append(torch.ones(1000))
del xs
import gc
gc.disable()  # as between two automatic collections: a tensor that only a reference cycle holds stays
cycle = {"tensor": torch.ones(75_000_000)}  # 300 MB
cycle["self"] = cycle
del cycle
held = rss_bytes()
save_checkpoint(model, sys.argv[1])
print(held, rss_bytes())
"""


@pytest.mark.skipif(heap._libc() is None, reason="malloc_trim is glibc's")
def test_a_checkpoint_save_gives_the_last_peak_back(tmp_path):
    """models/checkpoint.save_checkpoint releases the free heap (SmolLM2: the save's copies stacked on a 7.4 GB
    retained peak and the run was killed at its step-20 save)."""
    out = subprocess.run([sys.executable, "-c", SAVE_SCRIPT, str(tmp_path / "actor")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    held, after = map(int, out.stdout.split()[-2:])
    assert (tmp_path / "actor").is_dir()
    # measured: 927 -> 411 MB; without the garbage collection 967 -> 711; without the release 927 -> 931
    assert held - after > 400e6, f"RSS {held / 1e6:.0f} MB before the save, {after / 1e6:.0f} MB after"


def _cgroup_v2(tmp_path, levels: dict[str, dict[str, str]], own: str) -> tuple[str, str]:
    """A fake cgroup v2 mount (tmp/cg) with ``levels`` {relative path: {file: text}}, and a /proc/self/cgroup naming
    ``own``."""
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    for rel, files in levels.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / rel / name).write_text(text)
    (tmp_path / "proc_cgroup").write_text(f"0::{own}\n")
    return str(tmp_path / "proc_cgroup"), str(root)


GB = 1 << 30


def test_cgroup_v2_limit_of_an_ancestor(tmp_path):
    """Slurm's --mem: the job's cgroup (an ancestor of the step's, where the process is) holds the limit; page cache
    is not counted as used (the kernel reclaims it before it OOM-kills)."""
    proc, root = _cgroup_v2(tmp_path, {
        "job": {"memory.max": f"{4 * GB}\n", "memory.current": f"{3 * GB}\n",
                "memory.stat": f"anon {2 * GB}\ninactive_file {GB // 2}\nactive_file {GB // 2}\n"},
        "job/step": {"memory.max": "max\n", "memory.current": f"{3 * GB}\n", "memory.stat": "anon 1\n"}},
        own="/job/step")
    # used 3 - 0.5 - 0.5 = 2 GB of 4: half available
    assert heap.cgroup_available_fraction(proc, root, host_total=64 * GB) == pytest.approx(0.5)
    # a limit at or above the host's memory is no limit (cgroup v1 writes 2**63 - 4096 for "none")
    assert heap.cgroup_available_fraction(proc, root, host_total=4 * GB) is None


def test_cgroup_the_tightest_level_wins_and_missing_is_none(tmp_path):
    proc, root = _cgroup_v2(tmp_path, {
        "job": {"memory.max": f"{8 * GB}", "memory.current": f"{2 * GB}", "memory.stat": ""},  # 0.75 available
        "job/step": {"memory.max": f"{2 * GB}", "memory.current": f"{GB + GB // 2}", "memory.stat": ""}},  # 0.25
        own="/job/step")
    assert heap.cgroup_available_fraction(proc, root, host_total=64 * GB) == pytest.approx(0.25)
    assert heap.cgroup_available_fraction(str(tmp_path / "none"), root, host_total=64 * GB) is None
    (tmp_path / "proc_other").write_text("0::/elsewhere\n")  # a cgroup outside this mount (a namespace): no limit
    assert heap.cgroup_available_fraction(str(tmp_path / "proc_other"), root, host_total=64 * GB) is None


def test_cgroup_v1_memory_controller(tmp_path):
    mount = tmp_path / "cg" / "memory" / "docker" / "c1"
    mount.mkdir(parents=True)
    (mount / "memory.limit_in_bytes").write_text(f"{10 * GB}\n")
    (mount / "memory.usage_in_bytes").write_text(f"{9 * GB}\n")
    (mount / "memory.stat").write_text(f"cache {GB}\ntotal_inactive_file {GB}\ntotal_active_file 0\n")
    (tmp_path / "proc_cgroup").write_text("5:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n0::/\n")
    assert heap.cgroup_available_fraction(str(tmp_path / "proc_cgroup"), str(tmp_path / "cg"),
                                          host_total=64 * GB) == pytest.approx(0.2)


def test_available_fraction_takes_the_tighter(monkeypatch):
    """The host's fraction is psutil's available / total; a tighter cgroup limit's wins."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=600, total=1000))
    monkeypatch.setattr(heap, "cgroup_available_fraction", lambda host_total: 0.1)
    assert heap.available_fraction() == pytest.approx(0.1)
    monkeypatch.setattr(heap, "cgroup_available_fraction", lambda host_total: None)
    assert heap.available_fraction() == pytest.approx(0.6)


def test_this_machine_measures():
    """On the machine running the tests: a fraction in (0, 1] (no fake files)."""
    assert 0 < heap.available_fraction() <= 1


def test_release_only_when_memory_is_short(monkeypatch):
    released = []
    monkeypatch.setattr(heap, "release_free_heap", lambda: released.append(1) or True)
    assert heap.release_if_memory_short(0.25, lambda: 0.3) is None  # 30 % available: keep the heap
    assert released == []
    assert heap.release_if_memory_short(0.25, lambda: 0.2) == pytest.approx(0.2)  # short: release
    assert released == [1]
    assert heap.release_if_memory_short(0.0, lambda: 0.001) is None  # 0: never
    assert heap.release_if_memory_short(0.25, lambda: None) is None  # unknown: never
    assert released == [1]
