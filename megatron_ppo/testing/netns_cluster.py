"""Several "nodes" on one machine: a network namespace per node, joined by veth pairs on a bridge, each with its own
hostname (a UTS namespace), address and /etc/hosts (``ip netns exec`` binds /etc/netns/<ns>/hosts), and a Slurm
cluster on top: slurmctld on the first node, a slurmd on every node. What runs on a node (slurmd, the job steps it
starts, Ray, the ranks) sees only that node's address, so gloo rendezvous, Ray joins and MASTER_ADDR are real
cross-host paths; the filesystem stays shared, as on a cluster with a shared home.

Needs root and iproute2 (``ip netns``, veth, bridge) and Slurm's daemons; traffic goes only to the namespaces made
here and loopback. ``NetnsSlurmCluster.up()`` returns when every node is idle; ``down()`` kills every process of
every node, deletes the namespaces, the bridge and the hosts files, and is safe to call twice or after a failed up.
A person runs it through ``tools/netns_cluster.py``; tests/slurm/ through a fixture.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ppo.testing.slurm_client import TEST_CLUSTER_SETTINGS, SlurmClient

SLURMCTLD_PORT, SLURMD_PORT = 6817, 6818  # each node has its own port space
OWNER_FILE = "mppo_owner"  # /etc/netns/<ns>/mppo_owner: "<pid of the creator> <bridge> <veth>"


@dataclass(frozen=True)
class Node:
    name: str       # its hostname and Slurm NodeName
    netns: str      # the network namespace
    addr: str       # its address on the bridge
    veth: str       # the host end of its veth pair


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def _used_networks() -> list:
    out = _ip("-o", "-4", "addr", "show").stdout
    return [ipaddress.ip_interface(line.split()[3]).network for line in out.splitlines() if " inet " in line]


def _free_subnet(tag: int) -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no interface of this machine is on (several clusters may coexist)."""
    used = _used_networks()
    for k in range(256):
        net = ipaddress.ip_network(f"10.213.{(tag + k) % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("netns cluster: no free /24 in 10.213.0.0/16")


def can_make_netns() -> tuple[bool, str]:
    """(True, "") where this process can create network namespaces, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root"
    for tool in ("ip", "unshare", "nsenter"):
        if not shutil.which(tool):
            return False, f"no {tool!r} on PATH (iproute2, util-linux)"
    probe = f"mppo-probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def kill_namespace(netns: str) -> list[int]:
    """SIGKILL every process in network namespace ``netns`` (repeated: a process may fork while we kill)."""
    killed = []
    for _ in range(5):
        r = _ip("netns", "pids", netns, check=False)
        pids = [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return killed


def cleanup_stale() -> list[str]:
    """Remove the namespaces, veths and bridges of clusters whose creating process is gone (a test run that was
    killed before its teardown); returns the namespaces removed. Another live cluster is left alone."""
    removed = []
    root = Path("/etc/netns")
    for etc in sorted(root.glob("mppo-*")) if root.is_dir() else []:
        try:
            pid, bridge, veth = (etc / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        kill_namespace(etc.name)
        _ip("netns", "del", etc.name, check=False)
        _ip("link", "del", veth, check=False)
        _ip("link", "del", bridge, check=False)
        shutil.rmtree(etc, ignore_errors=True)
        removed.append(etc.name)
    return removed


class NetnsNodes:
    """The network: a bridge ``mppo<tag>br`` with the host at .1, and nodes ``node0..`` at .10, .11, ..."""

    def __init__(self, n: int, tag: str | None = None):
        if n < 1:
            raise ValueError(f"netns cluster: at least one node, got {n}")
        self.tag = tag or f"{os.getpid() % 0x10000:04x}"
        self.bridge = f"mppo{self.tag}br"
        self.net = _free_subnet(int(self.tag, 16))
        hosts = list(self.net.hosts())
        self.host_addr = str(hosts[0])
        self.nodes = [Node(f"node{i}", f"mppo-{self.tag}-n{i}", str(hosts[9 + i]), f"mppo{self.tag}v{i}")
                      for i in range(n)]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"netns cluster: no node {name!r} (nodes: {[n.name for n in self.nodes]})")

    def up(self) -> None:
        cleanup_stale()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_addr}/{self.net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in self.nodes)
        for n in self.nodes:
            _ip("netns", "add", n.netns)
            etc = Path("/etc/netns") / n.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / OWNER_FILE).write_text(f"{os.getpid()} {self.bridge} {n.veth}\n")
            _ip("link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.netns)
            _ip("link", "set", n.veth, "master", self.bridge, "up")
            for args in (("addr", "add", f"{n.addr}/{self.net.prefixlen}", "dev", "eth0"),
                         ("link", "set", "eth0", "up"), ("link", "set", "lo", "up")):
                _ip("netns", "exec", n.netns, "ip", *args)

    def argv(self, node: Node, argv: list[str]) -> list[str]:
        """``argv`` run on ``node``: in its network namespace, under its own hostname, with its /etc/hosts. Not
        ``ip netns exec``: that remounts /sys, and slurmd then finds no cgroup hierarchy; nsenter enters only the
        network namespace, and a private mount namespace takes the hosts file."""
        script = ('hosts=$1; name=$2; ns=$3; shift 3; mount --bind "$hosts" /etc/hosts && hostname "$name" && '
                  'exec nsenter --net=/run/netns/"$ns" -- "$@"')
        return ["unshare", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
                str(Path("/etc/netns") / node.netns / "hosts"), node.name, node.netns, *argv]

    def pids(self, node: Node) -> list[int]:
        r = _ip("netns", "pids", node.netns, check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    def kill_node(self, node: Node) -> list[int]:
        """SIGKILL every process of the node (a node that loses power); returns the pids killed."""
        return kill_namespace(node.netns)

    def link_down(self, node: Node) -> None:
        """The node's cable pulled: its processes live on, nobody reaches them."""
        _ip("link", "set", node.veth, "down")

    def link_up(self, node: Node) -> None:
        _ip("link", "set", node.veth, "up")

    def down(self) -> None:
        for n in self.nodes:
            if _ip("netns", "pids", n.netns, check=False).returncode == 0:
                self.kill_node(n)
                _ip("netns", "del", n.netns, check=False)
            shutil.rmtree(Path("/etc/netns") / n.netns, ignore_errors=True)
            _ip("link", "del", n.veth, check=False)
        _ip("link", "del", self.bridge, check=False)


class NetnsSlurmCluster(SlurmClient):
    """Slurm over ``NetnsNodes``: slurmctld on node0, a slurmd per node, config/state/logs under ``root``. The
    client commands (sbatch, scontrol, ...) run on the host with ``SLURM_CONF`` set and reach slurmctld over the
    bridge. Methods match tests/slurm/cluster.py's one-node cluster (run, job_state, job_fields, wait_done)."""

    def __init__(self, root: Path, n: int = 3, tag: str | None = None):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.net = NetnsNodes(n, tag)
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def nodes(self) -> list[Node]:
        return self.net.nodes

    def _node_resources(self) -> str:
        """CPUs=... RealMemory=... as ``slurmd -C`` measures this machine (every node reports the same)."""
        out = subprocess.run([_daemon("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
        fields = out.splitlines()[0].split()[1:]
        return " ".join(f for f in fields if not f.startswith("UpTime"))

    def write_conf(self) -> None:
        for sub in ("state", *(f"spool/{n.name}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r, head = self.root, self.nodes[0]
        res = self._node_resources()
        self.conf.write_text("\n".join([
            "ClusterName=mppo-netns",
            f"SlurmctldHost={head.name}({head.addr})",
            f"SlurmctldPort={SLURMCTLD_PORT}", f"SlurmdPort={SLURMD_PORT}",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd-%n.log",
            # a job that ran on a killed node stays COMPLETING until Slurm declares the node DOWN (SlurmdTimeout);
            # tests of node loss submit with --no-requeue, so that NODE_FAIL never requeues them
            *TEST_CLUSTER_SETTINGS,
            *(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} {res} State=UNKNOWN"
              for n in self.nodes),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]))

    def _start(self, key: str, node: Node, argv: list[str]) -> None:
        log = open(self.root / f"{key}.stdout", "w")
        self.procs[key] = subprocess.Popen(self.net.argv(node, argv), env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    def restart_node(self, name: str, timeout: float = 90.0) -> None:
        """A node back after ``kill_node``: its slurmd again (Slurm returns it to service on registration)."""
        node = self.net.node(name)
        self._start(f"slurmd-{node.name}", node, [_daemon("slurmd"), "-D", "-f", str(self.conf)])
        self.run("scontrol", "update", f"NodeName={node.name}", "State=RESUME", check=False)
        self.wait_idle(timeout)

    def up(self, timeout: float = 90.0) -> "NetnsSlurmCluster":
        try:
            self.net.up()
            self.write_conf()
            self._start("slurmctld", self.nodes[0], [_daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            for n in self.nodes:
                self._start(f"slurmd-{n.name}", n, [_daemon("slurmd"), "-D", "-f", str(self.conf)])
            self.wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def node_states(self) -> dict[str, str]:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict = {}
        while time.monotonic() < deadline:
            for key, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"netns slurm cluster: {key} exited with {p.returncode}: "
                                       f"{self.log_tail(key)}")
            states = self.node_states()
            if len(states) == len(self.nodes) and all(s in ("idle", "mix", "alloc") for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"netns slurm cluster: nodes not idle within {timeout:.0f} s: {states}; slurmctld: "
                           f"{self.log_tail('slurmctld')}")

    def log_tail(self, key: str, lines: int = 20) -> str:
        for path in (self.root / f"{key}.log", self.root / f"{key}.stdout"):
            if path.exists() and path.stat().st_size:
                return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def down(self) -> None:
        """Cancel jobs, stop the daemons, kill whatever is left on each node, remove the network."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=30)
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self.procs.clear()
        self.net.down()
