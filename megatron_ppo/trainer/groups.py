"""The driver's worker groups: one per role (actor, critic, ref, reward), on Ray or in this process, and their teardown.

cluster.launcher=ray: the layouts are checked against the cluster (``plan_placement`` -> ``check_fits``) BEFORE
Ray starts; then ``connect_or_start`` (cluster.ray_address, else $RAY_ADDRESS, else a local cluster sized to the
placement), one placement plan (colocated or split), and a ``RayWorkerGroup`` per role building its role worker
inside each rank. cluster.launcher=local: a ``LocalWorkerGroup`` per role in this process (TP = PP = DP = 1).
``RoleGroups.close()`` shuts down the groups, the placement and a cluster started here, whatever failed.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from megatron_ppo.distributed import (ClusterSlots, LocalWorkerGroup, RankLayout, RankResources, plan_placement)

log = logging.getLogger(__name__)

WORKER_CLASSES = {"actor": "megatron_ppo.workers.actor:ActorWorker",
                  "critic": "megatron_ppo.workers.critic:CriticWorker",
                  "ref": "megatron_ppo.workers.ref:RefWorker",
                  "reward": "megatron_ppo.workers.reward_model:RewardModelWorker"}


FROZEN_ROLES = ("ref", "reward")  # no optimizer, no lr schedule, never checkpointed


def layouts(cfg) -> dict[str, RankLayout]:
    """{role: RankLayout} from cluster.<role> (tensor/pipeline sizes, data_parallel_size or the world)."""
    out = {}
    for role in cfg.roles:
        p = getattr(cfg.cluster, role)
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        if p.data_parallel_size is None and cfg.cluster.launcher == "ray":
            out[role] = RankLayout.for_world(tp, pp, cfg.cluster.world_size, f"cluster.{role}")
        else:
            out[role] = RankLayout(tp, pp, cfg.cluster.data_parallel(role))
    return out


def on_gpu(cfg) -> bool:
    import torch

    return cfg.cluster.device == "cuda" or (cfg.cluster.device == "auto" and torch.cuda.is_available())


def plan(cfg):
    """The placement plan; refuses (LayoutError with the arithmetic) what the configured cluster cannot host."""
    c = cfg.cluster
    gpus = c.num_gpus_per_rank if c.num_gpus_per_rank is not None else (1.0 if on_gpu(cfg) else 0.0)
    slots = ClusterSlots(c.nnodes, c.n_gpus_per_node, "GPU" if gpus else "CPU")
    return plan_placement(layouts(cfg), slots, c.placement, RankResources(c.num_cpus_per_rank, gpus))


@dataclass
class RoleGroups:
    groups: dict = field(default_factory=dict)  # role -> WorkerGroup
    placement: object = None
    cluster: object = None

    def get(self, role: str):
        return self.groups.get(role)

    def close(self) -> None:
        """Shut down every group (reverse order: a local actor owns the process's parallel state), the placement
        and the Ray cluster started here. Idempotent; never raises over the error that brought us here."""
        for role in reversed(list(self.groups)):
            try:
                self.groups.pop(role).shutdown()
            except Exception as e:  # noqa: BLE001 - teardown goes on
                log.warning("shutting down the %s group: %s", role, e)
        if self.placement is not None:
            from megatron_ppo.distributed import remove_placement

            try:
                remove_placement(self.placement)
            except Exception as e:  # noqa: BLE001
                log.warning("removing the placement groups: %s", e)
            self.placement = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


def build_groups(cfg, vocab_size: int, total_steps: int, classes: dict | None = None) -> RoleGroups:
    """One worker group per role; ``classes`` overrides WORKER_CLASSES (tests: subclasses with probes)."""
    classes = {**WORKER_CLASSES, **(classes or {})}
    kwargs = {"cfg": cfg, "vocab_size": vocab_size}
    out = RoleGroups()
    try:
        if cfg.cluster.launcher == "local":
            for role, layout in layouts(cfg).items():
                if layout.world_size != 1:
                    raise ValueError(f"cluster.launcher=local hosts one rank per role; cluster.{role} asks for "
                                     f"{layout}")
                extra = {"total_steps": total_steps} if role not in FROZEN_ROLES else {}
                out.groups[role] = LocalWorkerGroup(role, classes[role], {**kwargs, **extra}, seed=cfg.trainer.seed)
            return out
        placement = plan(cfg)  # refusals happen here, before Ray starts
        import ray

        from megatron_ppo.distributed import RayWorkerGroup, connect_or_start, create_placement

        total_cpus = sum(sum(b.get("CPU", 0) for b in bundles) for bundles in placement.pools.values())
        total_gpus = sum(sum(b.get("GPU", 0) for b in bundles) for bundles in placement.pools.values())
        address = cfg.cluster.ray_address
        if ray.is_initialized():  # the caller's session (tests share one per module); not ours to stop
            log.info("using the Ray session this process already has")
        elif address or os.environ.get("RAY_ADDRESS"):  # an existing cluster: its resources are its own
            out.cluster = connect_or_start(address)
        else:  # a local cluster sized to the placement
            out.cluster = connect_or_start(None, num_cpus=total_cpus, num_gpus=total_gpus if total_gpus else None)
        out.placement = create_placement(placement)
        for role, layout in layouts(cfg).items():
            extra = {"total_steps": total_steps} if role not in FROZEN_ROLES else {}
            out.groups[role] = RayWorkerGroup(role, layout, placement.roles[role], classes[role], {**kwargs, **extra},
                                              seed=cfg.trainer.seed, collective_timeout_s=cfg.cluster.collective_timeout_s)
            log.info("%s: %s on Ray, up in %.1f s", role, layout, out.groups[role].timings["start_s"])
        return out
    except BaseException:
        out.close()
        raise
