"""A one-node Slurm cluster for the session (tests/slurm/cluster.py), torn down at the end.

Without Slurm installed the tests here are skipped locally, but fail under CI=true: CI installs Slurm (.ci/run),
so a skip there would mean the launch path went untested.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cluster import SlurmCluster, installed  # noqa: E402

from megatron_ppo.testing.netns_cluster import NetnsSlurmCluster, can_make_netns  # noqa: E402


def _need(what: str, ok: bool) -> None:
    if ok:
        return
    msg = f"{what} is not installed (apt-get install --no-install-recommends slurmctld slurmd slurm-client shellcheck)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true: {msg}; .ci/run installs it, so this must not be skipped")
    pytest.skip(msg)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    _need("Slurm (slurmctld, slurmd, slurm-client)", installed())
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def shellcheck():
    _need("shellcheck", shutil.which("shellcheck") is not None)
    return shutil.which("shellcheck")


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    """Three nodes as network namespaces with a slurmd each (megatron_ppo/testing/netns_cluster.py), removed at the
    end, also when a test fails."""
    _need("Slurm (slurmctld, slurmd, slurm-client)", installed())
    ok, why = can_make_netns()
    _need(f"network namespaces ({why})", ok)
    cluster = NetnsSlurmCluster(tmp_path_factory.mktemp("netns_slurm"), n=3).up()
    try:
        yield cluster
    finally:
        cluster.down()
