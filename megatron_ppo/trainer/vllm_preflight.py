"""Preflight of the vLLM engines' layout, from the config alone: the engines ``rollout.vllm_layout.plan_engines``
would place on the configured cluster (trainer.groups seats the ranks), refused with the numbers before anything
starts. Here, not in rollout/, because it reads the driver's placement plan (roles.py: nothing below the trainer
imports it)."""
from __future__ import annotations

from megatron_ppo.errors import UsageError
from megatron_ppo.rollout.vllm_layout import RankDevice, node_text, plan_engines, span_text


def _planned_devices(cfg) -> tuple[list[RankDevice], bool]:
    """The actor's ranks as the configured placement seats them (nodes node0, node1, ... as PACK fills them; GPU
    ids counted per node from each bundle's GPUs) and whether they hold GPUs. Raises LayoutError where the layout
    does not fit (trainer/entry.py reports that)."""
    from megatron_ppo.trainer.groups import layouts, on_gpu, plan

    gpu = on_gpu(cfg)
    if cfg.cluster.launcher == "local":  # one in-process rank on torch's first device
        return [RankDevice(0, 0, 0, 0, "node0", ("0",) if gpu else ())], gpu
    layout = layouts(cfg)["actor"]
    placement = plan(cfg, node_cpus=1)  # CPUs do not move ranks: a node takes cluster.n_gpus_per_node bundles
    rp = placement.roles["actor"]
    per_rank = placement.pools[rp.pool][0].get("GPU", 0.0) if gpu else 0.0  # what Ray shows a rank of a bundle
    slots: dict[str, int] = {}
    devices = []
    for rank in sorted(range(layout.world_size), key=lambda r: rp.bundle_indices[r]):
        node = rp.nodes[rank].host
        slot = slots[node] = slots.get(node, -1) + 1  # the bundle's place among the actor's bundles on its node
        if per_rank >= 1:
            gpus = tuple(str(slot * int(per_rank) + k) for k in range(int(per_rank)))
        else:  # fractional bundles packed onto GPUs (as Ray does while a GPU has room)
            gpus = (str(int(slot * per_rank)),) if per_rank > 0 else ()
        c = layout.coords(rank)
        devices.append(RankDevice(rank, c.tp, c.pp, c.dp, node, gpus))
    return sorted(devices, key=lambda d: d.rank), per_rank > 0


def check_engine_layout(cfg) -> None:
    """Preflight, from the config alone: the engines ``plan_engines`` would place on the configured cluster
    (UsageError with the numbers where vLLM's TP x PP is not an engine's GPUs; on cluster.device=cpu nothing to
    match), and weight_transport=file with a replica across nodes needs a shared rollout.vllm.weights_dir."""
    from megatron_ppo.distributed.layout import LayoutError

    v = cfg.rollout.vllm
    try:
        devices, gpu = _planned_devices(cfg)
    except LayoutError:
        return  # the layout itself does not fit: trainer/entry.py refuses it with the arithmetic
    plan_engines(devices, v.tensor_model_parallel_size, v.pipeline_model_parallel_size)  # CPU: one engine, any TP
    if v.weight_transport != "file" or v.weights_dir is not None:
        return
    spans: dict[int, dict[str, list[int]]] = {}
    for d in devices:
        spans.setdefault(d.dp, {}).setdefault(d.node, []).append(d.rank)
    dp, nodes = max(spans.items(), key=lambda item: len(item[1]))
    if len(nodes) > 1:
        a = cfg.cluster.actor
        where = ", ".join(f"ranks {span_text(ranks)} on {node_text(node)}" for node, ranks in list(nodes.items())[:4])
        raise UsageError(
            f"rollout.vllm.weights_dir: actor replicas span {len(nodes)} nodes (TP x PP = "
            f"{a.tensor_model_parallel_size * a.pipeline_model_parallel_size} ranks a replica, "
            f"{cfg.cluster.n_gpus_per_node} {'GPUs' if gpu else 'ranks'} per node; replica dp{dp}: {where}"
            f"{', ...' if len(nodes) > 4 else ''}); weight_transport=file needs a directory every node of a replica "
            "shares (the default /dev/shm is each node's own): set a shared file system path, or "
            "weight_transport=ipc (the default: other stages' weights relayed over torch.distributed)")
