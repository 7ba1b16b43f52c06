"""Test and benchmark probes on the role workers: kept out of the library's workers (``build_components(cfg,
worker_classes=PROBED_WORKERS)`` builds these instead)."""
from __future__ import annotations

from megatron_ppo.workers.actor import ActorWorker
from megatron_ppo.workers.critic import CriticWorker
from megatron_ppo.workers.ref import RefWorker
from megatron_ppo.workers.reward_model import RewardModelWorker


class WorkerProbes:
    def checksum(self) -> float:
        """Sum of |w| over this rank's shard, float64: a cheap fingerprint for "did the weights change"."""
        return float(sum(p.detach().double().abs().sum() for p in self.model.parameters()))

    def peak_rss_mb(self) -> float:
        """This rank's peak resident memory (the process's high-water mark), MiB."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ProbedActor(WorkerProbes, ActorWorker):
    pass


class ProbedCritic(WorkerProbes, CriticWorker):
    pass


class ProbedRef(WorkerProbes, RefWorker):
    pass


class ProbedReward(WorkerProbes, RewardModelWorker):
    pass


PROBED_WORKERS = {"actor": ProbedActor, "critic": ProbedCritic, "ref": ProbedRef, "reward": ProbedReward}
