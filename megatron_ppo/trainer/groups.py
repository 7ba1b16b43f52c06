"""The driver's worker groups: one per enabled role (megatron_ppo/roles.py), on Ray or in this process, and their teardown.

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

from megatron_ppo import roles
from megatron_ppo.distributed import (ClusterSlots, LocalWorkerGroup, RankLayout, RankResources, plan_placement)
from megatron_ppo.distributed.placement import auto_cpus_per_rank, bundles_per_node, local_cpu_count
from megatron_ppo.profiling import nsight_runtime_envs

log = logging.getLogger(__name__)


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


def shares_gpu(cfg, role: str, placement) -> bool:
    """Whether other processes use the GPU of each of the role's ranks (``placement``: its RolePlacement), each
    with a caching allocator of its own: a fraction of a GPU per rank (colocated roles split every bundle's GPU; a
    fractional cluster.num_gpus_per_rank lets Ray seat other ranks on it), or the actor beside its vLLM engine
    (started on the owner rank's GPU). Such ranks empty their CUDA cache after every call (RankActor.call); a rank
    with whole GPUs of its own keeps its cache (no other process could use it), and on CPU there is none."""
    gpus = placement.num_gpus
    return 0 < gpus < 1 or (gpus > 0 and role == "actor" and cfg.rollout.name == "vllm")


def cpus_per_rank(cfg, node_cpus: int | None = None) -> float:
    """cluster.num_cpus_per_rank, with ``auto`` resolved: ``node_cpus`` (default: this process's CPUs) over the
    bundles placed on one node; launcher=local: every role runs in this process, so all of ``node_cpus``."""
    c = cfg.cluster
    if c.num_cpus_per_rank != "auto":
        return float(c.num_cpus_per_rank)
    node_cpus = node_cpus or local_cpu_count()
    if c.launcher == "local":
        return float(node_cpus)
    slots = ClusterSlots(c.nnodes, c.n_gpus_per_node)
    return float(auto_cpus_per_rank(node_cpus, bundles_per_node(layouts(cfg), slots, c.placement)))


def plan(cfg, node_cpus: int | None = None):
    """The placement plan; refuses (LayoutError with the arithmetic) what the configured cluster cannot host.
    ``node_cpus``: the CPUs of one node for num_cpus_per_rank=auto (default: this process's)."""
    c = cfg.cluster
    gpus = c.num_gpus_per_rank if c.num_gpus_per_rank is not None else (1.0 if on_gpu(cfg) else 0.0)
    slots = ClusterSlots(c.nnodes, c.n_gpus_per_node, "GPU" if gpus else "CPU")
    return plan_placement(layouts(cfg), slots, c.placement, RankResources(cpus_per_rank(cfg, node_cpus), gpus))


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
    """One worker group per enabled role (roles.py: its worker class; a trainable role also gets the run's length
    for its lr schedule); ``classes`` overrides a role's worker class (tests: subclasses with probes)."""
    classes = {**{r.name: r.worker for r in roles.ROLES}, **(classes or {})}
    kwargs = {"cfg": cfg, "vocab_size": vocab_size}
    out = RoleGroups()
    try:
        if cfg.cluster.launcher == "local":
            import torch

            torch.set_num_threads(max(1, int(cpus_per_rank(cfg))))  # every role computes in this process
            for role, layout in layouts(cfg).items():
                if layout.world_size != 1:
                    raise ValueError(f"cluster.launcher=local hosts one rank per role; cluster.{role} asks for "
                                     f"{layout}")
                extra = {"total_steps": total_steps} if roles.spec(role).trainable else {}
                out.groups[role] = LocalWorkerGroup(role, classes[role], {**kwargs, **extra}, seed=cfg.trainer.seed)
                log.info("%s: in this process, %d torch threads", role, torch.get_num_threads())
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
        if cfg.cluster.num_cpus_per_rank == "auto" and (out.cluster is None or not out.cluster.started_here):
            from megatron_ppo.distributed.placement import ray_node_cpu_count

            placement = plan(cfg, ray_node_cpu_count())  # bundles sized from the cluster's nodes, not this one's
        out.placement = create_placement(placement)
        table = log_rank_table(layouts(cfg), out.placement)
        write_rank_table(table, cfg.trainer.log_dir)
        for role, layout in layouts(cfg).items():
            extra = {"total_steps": total_steps} if roles.spec(role).trainable else {}
            shared = shares_gpu(cfg, role, placement.roles[role])
            out.groups[role] = RayWorkerGroup(role, layout, placement.roles[role], classes[role], {**kwargs, **extra},
                                              seed=cfg.trainer.seed, collective_timeout_s=cfg.cluster.collective_timeout_s,
                                              nccl_timeout_s=cfg.cluster.nccl_timeout_s, release_device_cache=shared,
                                              release_heap_below_available=cfg.cluster.release_heap_below_available,
                                              runtime_envs=nsight_runtime_envs(cfg, role, layout.world_size,
                                                                               on_gpu(cfg)))
            out.groups[role].rank_table = table  # a lost node is named with every role's ranks on it
            rp, threads = placement.roles[role], sorted(set(out.groups[role].threads))
            log.info("%s: %s on Ray, %s torch thread(s) per rank (bundle of %g CPUs%s), groups time out after "
                     "%.0f s%s, up in %.1f s", role, layout, "/".join(map(str, threads)),
                     placement.pools[rp.pool][0].get("CPU", 0),
                     ", shared by the colocated roles" if placement.mode == "colocated" else "",
                     max(out.groups[role].group_timeout_s),
                     "; the GPU is shared: its CUDA cache is emptied after each call" if shared else "",
                     out.groups[role].timings["start_s"])
        return out
    except BaseException:
        out.close()
        raise


def log_rank_table(role_layouts: dict, placement) -> list[dict]:
    """Log where Ray seated every rank (one line per node) and warn about TP groups that span nodes; returns the
    rank table (placement.rank_table)."""
    from megatron_ppo.distributed.placement import format_rank_table, node_key, rank_table, split_tp_groups

    table = rank_table(role_layouts, placement)
    nodes = {node_key(row) for row in table}
    log.info("placement: %d rank(s) on %d node(s)\n  %s", len(table), len(nodes),
             "\n  ".join(format_rank_table(table)))
    for role, layout in role_layouts.items():
        rows = [row for row in table if row["role"] == role]
        split = split_tp_groups(layout, [node_key(row) for row in rows])
        if split:
            log.warning("%s: %d TP group(s) span nodes (ranks %s): TP collectives cross the network; make "
                        "cluster.n_gpus_per_node a multiple of TP=%d", role, len(split), split[:4], layout.tp)
    return table


PLACEMENT_FILE = "placement.json"  # in trainer.log_dir: the rank -> node table of the run's Ray groups


def write_rank_table(table: list[dict], log_dir: str | None) -> None:
    """``<log_dir>/placement.json``: one record per rank (role, rank, tp, pp, dp, pool, bundle, node, ip), the
    same records as ``megatron-ppo plan --placement --json`` plans."""
    if not log_dir:
        return
    import json

    os.makedirs(log_dir, exist_ok=True)
    tmp = os.path.join(log_dir, PLACEMENT_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, os.path.join(log_dir, PLACEMENT_FILE))
