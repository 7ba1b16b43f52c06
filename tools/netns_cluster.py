"""A Slurm cluster of N network-namespace nodes on this machine (root), for trying multi-node jobs by hand:

    sudo .venv/bin/python tools/netns_cluster.py up --nodes 3            # prints SLURM_CONF=...; Ctrl-C tears down
    SLURM_CONF=<printed path> sbatch --nodes=3 slurm/ppo_tiny.sh cluster.nnodes=3 cluster.n_gpus_per_node=2 ...
    sudo .venv/bin/python tools/netns_cluster.py kill node2              # in another shell: a node dies
    sudo .venv/bin/python tools/netns_cluster.py cleanup                 # leftovers of a cluster whose owner died

Each node: its own network namespace, address (10.213.x.10+i), hostname (node<i>), /etc/hosts and slurmd;
slurmctld runs on node0. What `up` made is removed when it ends (Ctrl-C, SIGTERM, or an error).
megatron_ppo/testing/netns_cluster.py has the details; tests/slurm/test_slurm_multinode.py uses the same code.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_ppo.testing.netns_cluster import (NetnsSlurmCluster, can_make_netns, cleanup_stale,  # noqa: E402
                                               kill_namespace)

STATE = Path(tempfile.gettempdir()) / "mppo-netns-cluster.json"  # the running `up`'s nodes, for `kill`


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring the cluster up and keep it until Ctrl-C")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--dir", default=None, help="Slurm config, state and logs (default: a new temp dir)")
    kill = sub.add_parser("kill", help="SIGKILL every process of one node of the running cluster")
    kill.add_argument("node")
    sub.add_parser("cleanup", help="remove namespaces, veths and bridges of clusters whose owner is gone")
    args = p.parse_args(argv)
    if args.cmd == "cleanup":
        print("removed:", " ".join(cleanup_stale()) or "nothing")
        return 0
    ok, why = can_make_netns()
    if not ok:
        print(f"netns_cluster: cannot make network namespaces: {why}", file=sys.stderr)
        return 2
    if args.cmd == "kill":
        netns = json.loads(STATE.read_text())["netns"] if STATE.exists() else {}
        if args.node not in netns:
            print(f"netns_cluster: no node {args.node!r} in a running cluster (nodes: {sorted(netns)})",
                  file=sys.stderr)
            return 2
        print(f"killed {len(kill_namespace(netns[args.node]))} processes of {args.node}")
        return 0
    root = Path(args.dir or tempfile.mkdtemp(prefix="mppo-netns-"))
    root.mkdir(parents=True, exist_ok=True)
    cluster = NetnsSlurmCluster(root, n=args.nodes)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster.up()
        STATE.write_text(json.dumps({"netns": {n.name: n.netns for n in cluster.nodes}}))
        for n in cluster.nodes:
            print(f"{n.name}: {n.addr} (netns {n.netns})")
        print(f"export SLURM_CONF={cluster.conf}   # then sbatch / sinfo / squeue from any shell; Ctrl-C here ends it")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.down()
        STATE.unlink(missing_ok=True)
        print("netns cluster removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
