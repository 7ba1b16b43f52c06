"""The process groups' timeout per backend (issue 47): NCCL groups get cluster.nccl_timeout_s (a synchronous
checkpoint save keeps NCCL peers waiting for minutes, and NCCL's watchdog aborts at the timeout); gloo keeps the
fail-fast backstop, cluster.collective_timeout_s, in torch's default group and in every group Megatron makes."""
from __future__ import annotations

from megatron_ppo import parallel


def test_the_backend_picks_the_timeout():
    assert parallel.group_timeout_s("nccl", 120, 1800) == 1800
    assert parallel.group_timeout_s("gloo", 120, 1800) == 120
    assert parallel.group_timeout_s("nccl", 120, None) == 120  # no NCCL timeout given: the one timeout


def test_gloo_groups_keep_the_fail_fast_timeout():
    from megatron.core import parallel_state as ps

    from megatron_ppo.parallel.platform import disable_cpu_platform

    parallel.initialize(tp=1, pp=1, seed=1, timeout_s=77, nccl_timeout_s=1800)
    try:
        groups = {"world": None, "tp": ps.get_tensor_model_parallel_group(),
                  "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group(),
                  "dp_gloo": ps.get_data_parallel_group_gloo(), "mp": ps.get_model_parallel_group()}
        got = {name: parallel.process_group_timeout_s(g) for name, g in groups.items()}
        assert got == dict.fromkeys(groups, 77.0), got  # read back from torch: not NCCL's 1800 on gloo
    finally:
        parallel.destroy()
        disable_cpu_platform()
