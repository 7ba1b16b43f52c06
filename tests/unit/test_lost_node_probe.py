"""A failed worker group names a node that stopped answering, with every role's ranks on it
(distributed/ray_group.py: lost_nodes), probing real sockets: one node's "node manager" listens, the other's port
is closed (a killed node: connection refused)."""
from __future__ import annotations

import socket

from megatron_ppo.distributed.layout import RankLayout
from megatron_ppo.distributed.ray_group import RayWorkerGroup, _probe


def _closed_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_lost_node_is_named_with_every_roles_ranks_and_a_live_one_is_not():
    alive = socket.socket()
    alive.bind(("127.0.0.1", 0))
    alive.listen()
    try:
        group = RayWorkerGroup.__new__(RayWorkerGroup)  # the probe needs no Ray: infos, ports and table only
        group.role, group.layout = "actor", RankLayout(tp=2, pp=1, dp=2)
        group.infos = [{"node_ip": "127.0.0.1", "host": "node0", "pid": 1}, {"node_ip": "127.0.0.1", "host": "node0"},
                       {"node_ip": "127.0.0.2", "host": "node1"}, {"node_ip": "127.0.0.2", "host": "node1"}]
        group.node_ports = {"127.0.0.1": alive.getsockname()[1], "127.0.0.2": _closed_port("127.0.0.2")}
        group.rank_table = [{"role": role, "rank": r, "ip": "127.0.0.1" if r < 2 else "127.0.0.2"}
                            for role in ("actor", "critic") for r in range(4)]
        lines = group.lost_nodes(timeout_s=1.0)
        assert len(lines) == 1, lines
        assert lines[0].startswith("node node1 (127.0.0.2) lost: its Ray node manager at 127.0.0.2:"), lines
        assert "connection refused" in lines[0] and lines[0].endswith("it held actor ranks 2-3; critic ranks 2-3")
        group.rank_table = []  # no table from the driver: this role's ranks, from the group's own infos
        assert group.lost_nodes(timeout_s=1.0)[0].endswith("it held actor ranks 2-3")
    finally:
        alive.close()
    assert _probe("127.0.0.1", _closed_port("127.0.0.1"), 1.0) == "connection refused"
