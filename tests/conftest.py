"""Shared test fixtures: a single-process Megatron world, and a pool of 2 local ranks for multi-process tests.

Hypothesis profiles (``HYPOTHESIS_PROFILE=ci|dev``, or pytest's ``--hypothesis-profile``):
  ``ci``   reproducible: derandomized (examples derived from each test's source), no example database, no deadline
           (2 busy cores cannot promise one), failing examples printed with their reproduction blob; .ci/run uses it.
  ``dev``  the default: random exploration, local example database (replays past failures), no deadline.
Settings written on a test (``settings(max_examples=...)``) override only the keys they name.
"""
from __future__ import annotations

import os

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
