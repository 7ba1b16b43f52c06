"""Shared test fixtures: a single-process Megatron world, and a pool of 2 local ranks for multi-process tests.

Hypothesis profiles (``HYPOTHESIS_PROFILE=ci|dev``, or pytest's ``--hypothesis-profile``):
  ``ci``   reproducible: derandomized (examples derived from each test's source), no example database, no deadline
           (2 busy cores cannot promise one), failing examples printed with their reproduction blob; .ci/run uses it.
  ``dev``  the default: random exploration, local example database (replays past failures), no deadline.
Settings written on a test (``settings(max_examples=...)``) override only the keys they name.
"""
from __future__ import annotations

import os
import time

import pytest
from hypothesis import settings

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, derandomize=False)  # explicit: under CI=true Hypothesis's default is derandomized
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def dist_pool2():
    """Two long-lived gloo ranks (spawned once per session): ``dist_pool2.run(fn, *args) -> [rank0, rank1]``.

    ``fn(rank, world_size, *args)`` must be module-level; it initialises and destroys its parallel layout itself.
    """
    from megatron_ppo.parallel.launch import LocalWorkerPool

    with LocalWorkerPool(2) as pool:
        yield pool


@pytest.fixture
def megatron_single():
    """A world-of-one Megatron (TP=PP=DP=1) initialised for the test and torn down after it."""
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform

    parallel.initialize(tp=1, pp=1, seed=1234)
    try:
        yield
    finally:
        parallel.destroy()
        disable_cpu_platform()  # later tests in this process run without the CUDA->CPU remap


@pytest.fixture
def reward_registry():
    """The global reward registry, restored after the test: tests that register fixed names can rerun in the
    same process (pytest --count, a REPL, the mutation script)."""
    from megatron_ppo.rewards import registry

    registry._load_builtins()
    saved = dict(registry._REGISTRY)
    try:
        yield registry
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)


# ------------------------------------------------------------------------------------------------ CI diagnostics
# A CI run cut off by its time limit prints no summary: under CI=true each failure is printed the moment it happens
# (nodeid, phase, the error's last lines), and once MPPO_TEST_BUDGET_S seconds have passed the remaining tests fail
# at once (naming the budget), so pytest still reaches its summary and exit code before the job's limit.
_SESSION_START = [None]
_monotonic = time.monotonic  # bound once: a test that patches time.monotonic must not reach these hooks


def pytest_sessionstart(session):
    _SESSION_START[0] = _monotonic()


def pytest_runtest_setup(item):
    budget = float(os.environ.get("MPPO_TEST_BUDGET_S", "0") or 0)
    if budget and _SESSION_START[0] is not None and _monotonic() - _SESSION_START[0] > budget:
        pytest.fail(f"MPPO_TEST_BUDGET_S={budget:.0f} s spent before this test started (not run)", pytrace=False)


def pytest_runtest_teardown(item, nextitem):
    """After a test module's last test: return the heap it freed to the OS. The suite runs hundreds of in-process
    Megatron tests in this one process; memory it kept would be taken from the subprocess tests that follow (in a
    full run here the Slurm tests at its end took 2.5x their time alone; cause not yet confirmed: the SLOW-NOW lines
    below print this process's RSS and the memory available)."""
    import psutil

    if (nextitem is None or nextitem.module is not item.module) and psutil.Process().memory_info().rss > 2 * 2 ** 30:
        from megatron_ppo.models.heap import release_free_heap

        release_free_heap()  # ~0.2 s: only when this process holds over 2 GiB


def _memory_note() -> str:
    import psutil

    gib = 2 ** 30
    return (f"; pytest RSS {psutil.Process().memory_info().rss / gib:.1f} GiB, available "
            f"{psutil.virtual_memory().available / gib:.1f} GiB")


def pytest_runtest_logreport(report):
    import sys

    if os.environ.get("CI") != "true":
        return
    elapsed = _monotonic() - _SESSION_START[0] if _SESSION_START[0] is not None else 0.0
    if report.when == "call" and report.duration > 60:
        # a test's own phase timings (record_property), so a slow CI run says where its time went
        phases = ", ".join(f"{k} {v}" for k, v in report.user_properties)
        sys.stderr.write(f"\nSLOW-NOW [{elapsed:.0f} s] {report.nodeid}: {report.duration:.0f} s"
                         f"{f' ({phases})' if phases else ''}{_memory_note()}\n")
    if not report.failed:
        return
    text = str(report.longrepr or "").strip().splitlines()
    tail = "\n    ".join(text[-12:])
    sys.stderr.write(f"\nFAILED-NOW [{elapsed:.0f} s] {report.nodeid} ({report.when}, {report.duration:.1f} s):\n"
                     f"    {tail}\n")
    sys.stderr.flush()
