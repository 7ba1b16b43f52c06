"""Where the vLLM engines of the actor run, and over which GPUs (issue 48 item 1).

One engine per node that an actor DP replica spans, over the replica's GPUs on that node: a replica's TP x PP
ranks hold GPUs the engine would otherwise leave idle while it generates, and vLLM's own TP x PP must stay inside a
node. On a one-node replica that is one engine per replica (the only case before); ppo_70b's TP8 x PP4 replica
spans 4 nodes of 8 GPUs and gets 4 engines of TP8, each a whole copy of the policy serving a quarter of the
replica's prompts (``rows_of``). On CPU (no rank holds a GPU): exactly one engine per replica, on the
representative.

Who is who (megatron's rank order, rank = tp + TP*dp + TP*DP*pp, docs/distributed.md): the representative of a
replica (its answer is the one the driver keeps) is tp=0 on the last stage; the owner of an engine (starts it,
talks to it) is the replica's rank on that node with tp=0 and the highest pp there, so on the representative's
node the owner is the representative.

``plan_engines`` is pure: the ranks' devices in, the engines out, refused (UsageError with the numbers) where the
engine's parallelism and the replica's GPUs disagree. ``gather_rank_devices`` collects the devices at run time (a
collective: every actor rank calls it); trainer/vllm_preflight.py runs the same plan on the configured placement
for preflight, from the config alone.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megatron_ppo.errors import UsageError

__all__ = ["RankDevice", "EnginePlacement", "local_rank_device", "gather_rank_devices", "plan_engines",
           "engine_for_rank", "rows_of", "engine_env", "check_engine_layout"]

TP_KEY = "rollout.vllm.tensor_model_parallel_size"
PP_KEY = "rollout.vllm.pipeline_model_parallel_size"


@dataclass(frozen=True)
class RankDevice:
    """One actor rank: its coordinates, its node, and its GPUs as CUDA_VISIBLE_DEVICES names them (() on CPU)."""

    rank: int
    tp: int
    pp: int
    dp: int
    node: str
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class EnginePlacement:
    """One vLLM engine: replica ``dp``'s engine ``index`` of ``count``, on ``node``, started by rank ``owner``,
    over ``gpus`` (the replica's ranks ``ranks`` on that node hold them), with vLLM's TP and PP."""

    dp: int
    index: int
    count: int
    node: str
    owner: int
    ranks: tuple[int, ...]
    gpus: tuple[str, ...]
    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def cuda_visible_devices(self) -> Optional[str]:
        return ",".join(self.gpus) or None


# ------------------------------------------------------------------------------------------------ a rank's device

def _under_ray() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _visible(env: Mapping[str, str]) -> Optional[list[str]]:
    value = env.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def rank_gpus(env: Mapping[str, str], under_ray: bool, cuda_available: bool) -> tuple[str, ...]:
    """This rank's GPUs as CUDA_VISIBLE_DEVICES names them. Ray sets CUDA_VISIBLE_DEVICES to exactly an actor's
    GPUs (LOCAL_RANK=0): all of them. torchrun shows a rank all of the node's GPUs and LOCAL_RANK picks one:
    visible[LOCAL_RANK], or str(LOCAL_RANK) when nothing restricts them. () without a GPU."""
    visible = _visible(env)
    if under_ray:
        return tuple(visible or ())
    if visible is not None:
        if not visible:
            return ()
        local = int(env.get("LOCAL_RANK", "0"))
        if local >= len(visible):
            raise UsageError(f"LOCAL_RANK={local} but CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} shows "
                             f"{len(visible)} GPU(s): this rank has no GPU of its own")
        return (visible[local],)
    return (env.get("LOCAL_RANK", "0"),) if cuda_available else ()


def _node_address() -> str:
    """What tells this rank's node apart: Ray's node IP (as RankActor.info reports it), else the local address
    this rank reaches MASTER_ADDR from (hostnames repeat across network namespaces on one host)."""
    if _under_ray():
        import ray

        return ray.util.get_node_ip_address()
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "1") or 1)))  # UDP: no packet is sent
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


def local_rank_device() -> RankDevice:
    """This actor rank's RankDevice (Megatron's parallel state must be initialised)."""
    import torch

    from megatron_ppo import parallel

    gpus = rank_gpus(os.environ, _under_ray(), torch.cuda.is_available())
    return RankDevice(parallel.world_rank(), parallel.tp_rank(), parallel.pp_rank(), parallel.dp_rank(),
                      _node_address(), gpus)


def gather_rank_devices() -> list[RankDevice]:
    """Every actor rank's RankDevice, in rank order: a collective over the default group (every rank calls it)."""
    import torch.distributed as dist

    mine = local_rank_device()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return list(out)


# ------------------------------------------------------------------------------------------------ the plan (pure)

def span_text(ranks: Sequence[int]) -> str:
    from megatron_ppo.distributed.placement import rank_span

    return rank_span(ranks)


def node_text(node: str) -> str:
    return node if node.startswith("node") else f"node {node}"


def _engine_size(n_gpus: int, engine_tp: Optional[int], engine_pp: int, where: str) -> int:
    """vLLM's TP for an engine over ``n_gpus``; refuses a TP x PP that is not ``n_gpus``."""
    if engine_tp is None:
        if n_gpus % engine_pp:
            raise UsageError(f"{PP_KEY} ({engine_pp}) does not divide an engine's GPUs: {where}, and with "
                             f"tensor_model_parallel_size null an engine takes them all: set "
                             f"pipeline_model_parallel_size to a divisor of {n_gpus}")
        return n_gpus // engine_pp
    if engine_tp * engine_pp != n_gpus:
        fix = (f"set tensor_model_parallel_size to {n_gpus // engine_pp}, or null" if n_gpus % engine_pp == 0 else
               f"set pipeline_model_parallel_size to a divisor of {n_gpus} and tensor_model_parallel_size to null")
        raise UsageError(f"{TP_KEY} ({engine_tp}) x pipeline_model_parallel_size ({engine_pp}) = "
                         f"{engine_tp * engine_pp} GPUs per engine, but {where}; one vLLM engine per node of an "
                         f"actor replica takes the replica's GPUs there: {fix}")
    return engine_tp


def plan_engines(devices: Sequence[RankDevice], engine_tp: Optional[int], engine_pp: int) -> list[EnginePlacement]:
    """The actor's vLLM engines, ordered by replica, then by the node of their lowest rank. An engine's GPUs are its
    replica's ranks' GPUs on its node, each once, in rank order (colocated roles may share a GPU; a rank may hold
    several). Refuses (UsageError) a TP x PP that is not an engine's GPU count, a node of a replica without a tp=0
    rank to own its engine, and ranks of which some hold GPUs and some not."""
    if not devices:
        raise UsageError("plan_engines: no actor ranks")
    if engine_pp < 1 or (engine_tp is not None and engine_tp < 1):
        raise UsageError(f"{TP_KEY} ({engine_tp}) and {PP_KEY} ({engine_pp}) must be positive")
    devices = sorted(devices, key=lambda d: d.rank)
    ranks = [d.rank for d in devices]
    if len(set(ranks)) != len(ranks):
        raise UsageError(f"plan_engines: ranks {ranks} repeat")
    with_gpu = [d.rank for d in devices if d.gpus]
    if with_gpu and len(with_gpu) != len(devices):
        without = [d.rank for d in devices if not d.gpus]
        raise UsageError(f"actor ranks {span_text(with_gpu)} hold GPUs but ranks {span_text(without)} none: a vLLM "
                         "engine needs its replica's ranks all on GPUs or all on the CPU")
    replicas: dict[int, list[RankDevice]] = {}
    for d in devices:
        replicas.setdefault(d.dp, []).append(d)
    out: list[EnginePlacement] = []
    for dp in sorted(replicas):
        members = replicas[dp]
        if not with_gpu:  # CPU: one engine per replica, on its representative
            last = max(d.pp for d in members)
            rep = [d for d in members if d.tp == 0 and d.pp == last]
            if not rep:
                raise UsageError(f"actor replica dp{dp} (ranks {span_text([d.rank for d in members])}) has no rank "
                                 f"with tp=0 on its last stage pp{last} to own its engine")
            out.append(EnginePlacement(dp, 0, 1, rep[0].node, rep[0].rank, tuple(d.rank for d in members), (),
                                       engine_tp or 1, engine_pp))
            continue
        nodes: dict[str, list[RankDevice]] = {}
        for d in members:
            nodes.setdefault(d.node, []).append(d)
        engines = []
        for node, here in sorted(nodes.items(), key=lambda item: item[1][0].rank):
            held = tuple(r.rank for r in here)
            owners = [r for r in here if r.tp == 0]
            if not owners:
                raise UsageError(f"actor replica dp{dp} has ranks {span_text(held)} on {node_text(node)} but none with "
                                 "tp=0 (a TP group spans nodes): no rank there can own a vLLM engine; make "
                                 "cluster.n_gpus_per_node a multiple of cluster.actor.tensor_model_parallel_size")
            owner = max(owners, key=lambda r: (r.pp, -r.rank))
            gpus = tuple(dict.fromkeys(g for r in here for g in r.gpus))
            where = f"actor replica dp{dp} holds {len(gpus)} GPUs on {node_text(node)} (ranks {span_text(held)})"
            tp = _engine_size(len(gpus), engine_tp, engine_pp, where)
            engines.append((node, owner.rank, held, gpus, tp))
        for index, (node, owner, held, gpus, tp) in enumerate(engines):
            out.append(EnginePlacement(dp, index, len(engines), node, owner, held, gpus, tp, engine_pp))
    return out


def engine_for_rank(placements: Sequence[EnginePlacement], rank: int) -> Optional[EnginePlacement]:
    """The engine ``rank`` owns (starts and talks to), or None."""
    return next((p for p in placements if p.owner == rank), None)


def rows_of(n_rows: int, index: int, count: int) -> slice:
    """Engine ``index`` of ``count``'s contiguous share of a replica's ``n_rows`` prompts (sizes differ by at most
    one, the first engines take the extra rows)."""
    if count < 1 or not 0 <= index < count or n_rows < 0:
        raise ValueError(f"rows_of: n_rows={n_rows}, index={index}, count={count}")
    base, extra = divmod(n_rows, count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def engine_env(placement: EnginePlacement, base: Mapping[str, str]) -> dict:
    """The engine process's environment: ``base`` with CUDA_VISIBLE_DEVICES = the engine's GPUs. On CPU ``base``'s
    own setting stays (a rank without a GPU must not hand its engine the host's GPUs by dropping an empty value)."""
    env = dict(base)
    if placement.gpus:
        env["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices
    return env
