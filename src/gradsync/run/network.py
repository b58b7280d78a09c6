"""network=shaped: the ranks of one job on a network of their own, shaped to a rate
(docs/slow-network.md). network=local (the default) is today's job, unchanged.

Per run, named with the launcher's pid (``gs<pid>``): one bridge (``gs<pid>br``, no address:
nothing outside the run reaches the ranks, and no route leads out), and per rank a network
namespace (``gs<pid>r<rank>``) joined to the bridge by a veth pair (``gs<pid>h<rank>`` on the
host's side, ``gs<pid>n<rank>`` inside), an address 10.a.b.<rank + 1>/24 (a and b from the pid),
and ``tc``'s token bucket (tbf) on both ends of the pair: each direction of each rank's link is
shaped to ``network.rate``, over a queue TCP does not overflow, and TCP in the namespaces is
reno (steady over tbf). A rank enters its namespace as it starts (setns), gloo binds to the
veth inside (GLOO_SOCKET_IFNAME) and the job's TCPStore listens in rank 0's namespace: the
rendezvous and every collective cross the shaped links.

Everything is removed when the launcher leaves, however it leaves (a normal end, an error,
Ctrl-C, SIGTERM: launch.py's ``finally``); after a kill -9 of the launcher the next shaped start
removes what a launcher that no longer lives left (``remove_leftovers``).

The bytes each link carried are the kernel's counters of the host's end of the pair
(/sys/class/net/<veth>/statistics): what the rank received is that end's tx, what it sent its rx.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gradsync.components import ConfigError, require

NETWORKS = ("local", "shaped")
PREFIX = "gs"
MAX_RANKS = 16
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")
SYS_NET = Path("/sys/class/net")
TCP_CC = Path("/proc/sys/net/ipv4/tcp_congestion_control")  # the namespace's, read inside it
# what the link carries beyond the engine's bytes: Ethernet (14 B, as the veth counts it), IPv4
# (20 B) and TCP (20 B + 12 B of timestamps) headers per segment of at most 1448 B of payload
# (MTU 1500); besides, the ACKs of the other direction, gloo's own framing and the rendezvous
HEADER_BYTES = 14 + 20 + 32
SEGMENT_BYTES = 1448
OVERHEAD = ("per TCP segment of <= 1448 B: 66 B of Ethernet, IPv4 and TCP headers (4.6 %); "
            "plus the ACKs of the other direction, gloo's framing, the rendezvous and the "
            "job's small collectives (the stop agreement, evaluation, the summary)")

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)"
                   r"\s*$", re.I)
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us|ns)?\s*$", re.I)
_TIME_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


class NetworkError(RuntimeError):
    """The shaped network cannot be made here (tools, privileges, a name in use): one line."""


def rate_bits(rate: str) -> float:
    """A tc rate (e.g. 100mbit, 1gbit, 10mbps = bytes/s) in bits per second; ValueError if it is
    not one."""
    m = _RATE.match(str(rate))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a tc rate: {rate!r}")
    return float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]


def seconds(text: str) -> float:
    """A tc time (5us, 2ms, 0.1s; a bare number: seconds) in seconds; ValueError if not one."""
    m = _TIME.match(str(text))
    if not m:
        raise ValueError(f"not a time: {text!r}")
    return float(m.group(1)) * _TIME_SCALE[(m.group(2) or "s").lower()]


@dataclass
class NetworkConfig:
    """network=local | shaped (conf/network/). rate: each direction of each rank's link
    (a tc rate: 20mbit, 1gbit, ...); delay: one way, per link (netem; refused where the kernel
    has no netem: the projection, gradsync-project, carries latency instead)."""

    name: str = "local"
    rate: str = "1gbit"
    delay: str = "0ms"

    @property
    def shaped(self) -> bool:
        return self.name == "shaped"

    @property
    def rate_bits(self) -> float:
        return rate_bits(self.rate)

    def check(self) -> None:
        require(self.name in NETWORKS, "network.name", f"one of {', '.join(NETWORKS)}",
                self.name)
        if not self.shaped:
            return
        try:
            bits = rate_bits(self.rate)
        except ValueError:
            raise ConfigError(f"network.rate={self.rate!r}: a tc rate, a number > 0 and its "
                              "unit (bit, kbit, mbit, gbit, tbit; bps, kbps, mbps, gbps: bytes "
                              "per second), e.g. 100mbit") from None
        require(bits >= 8e3, "network.rate", "at least 8kbit (below it a step takes hours)",
                self.rate)
        try:
            delay = seconds(self.delay)
        except ValueError:
            raise ConfigError(f"network.delay={self.delay!r}: a time, e.g. 0ms, 5ms, "
                              "200us") from None
        if delay > 0 and not netem_available():
            raise ConfigError(f"network.delay={self.delay}: this kernel has no netem (tc's "
                              "delay); leave network.delay=0ms and add the latency in the "
                              "projection: gradsync-project RUN_DIR --link RATE,LATENCY")

    def check_job(self, world_size: int, backend: str, spawns: bool) -> None:
        """The job can run on a shaped network here: ranks this launcher starts (2 to 16, gloo),
        ip and tc, root. One line (ConfigError) otherwise; nothing is made."""
        if not self.shaped:
            return
        if not spawns:
            raise ConfigError("network=shaped: the ranks must be started by gradsync-train "
                              "itself (trainer.devices=2..16), not by torchrun, srun or "
                              "submitit")
        require(2 <= world_size <= MAX_RANKS, "trainer.devices",
                f"2 to {MAX_RANKS} ranks with network=shaped (one link each)", world_size)
        if backend != "gloo":
            raise ConfigError(f"network=shaped: CPU ranks on gloo only (trainer.backend="
                              f"{backend})")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise ConfigError(f"network=shaped needs {' and '.join(missing)} (iproute2) on "
                              "PATH")
        if os.geteuid() != 0:
            raise ConfigError("network=shaped needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN: it "
                              "makes network namespaces, veth pairs and tc qdiscs)")


def network_config(node: dict[str, Any] | None) -> NetworkConfig:
    """The composed network node (absent: local), checked."""
    node = dict(node or {})
    known = set(NetworkConfig.__dataclass_fields__)
    for key in node:
        require(key in known, f"network.{key}", f"one of {', '.join(sorted(known))}", key)
    cfg = NetworkConfig(**node)
    for key in known:
        require(isinstance(getattr(cfg, key), str), f"network.{key}", "a string",
                getattr(cfg, key))
    cfg.check()
    return cfg


def process_group_engine(engine: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A shaped run's engine settings: its all-reduce through the process group, over the
    links (engine.allreduce=auto -> process_group; shared_memory refused); the line that says
    so, if anything changed."""
    allreduce = engine.get("allreduce")
    if allreduce == "shared_memory":
        raise ConfigError("network=shaped with engine.allreduce=shared_memory: the ranks' "
                          "gradients would bypass the links; use auto or process_group")
    if allreduce == "auto":
        return engine | {"allreduce": "process_group"}, (
            "network=shaped: engine.allreduce=process_group (gloo over the shaped links; no "
            "shared-memory shortcut between ranks)")
    return engine, None


def netem_available() -> bool:
    if Path("/sys/module/sch_netem").exists():
        return True
    modules = Path("/lib/modules") / os.uname().release
    return modules.is_dir() and any(modules.rglob("sch_netem.ko*"))


@dataclass(frozen=True)
class Link:
    """One rank's end of the network: its namespace, the veth inside it, its address."""

    netns: str
    ifname: str
    address: str

    def enter(self) -> None:
        """Move the calling thread (a rank's only thread, as it starts) into the namespace,
        and bind gloo to the veth."""
        enter_netns(self.netns)
        os.environ["GLOO_SOCKET_IFNAME"] = self.ifname
        os.environ["MASTER_ADDR"] = self.address


PROBE_WARMUP, PROBE_CALLS = 3, 20
# tbf's queue: deep enough that TCP loses nothing to it (a queue of 50 ms at the rate dropped a
# sixth of a 20mbit run's segments, resent: the link carried them twice and the step took a
# sixth longer than its bytes); a switch's buffer, not a wire's, at low rates
QUEUE_BYTES = 8 << 20


def hop_latency() -> dict[str, float]:
    """The latency a ring all-reduce meets per hop on these links (every rank calls it as it
    joins the group, before the engine: a collective): all-reduces of one float, timed after
    a few to warm up; the median call over a ring's 2(p-1) hops. It holds what the rate does
    not: the propagation delay, the kernel's and gloo's per-message work, a process waking."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    p = dist.get_world_size()
    one = torch.zeros(1)
    took = []
    for i in range(PROBE_WARMUP + PROBE_CALLS):
        start = time.perf_counter()
        dist.all_reduce(one)
        if i >= PROBE_WARMUP:
            took.append(time.perf_counter() - start)
    return {"hop_latency_s": statistics.median(took) / (2 * (p - 1))}


def enter_netns(netns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


T = TypeVar("T")


def inside(netns: str, fn: Callable[[], T]) -> T:
    """fn() called on a thread of its own inside the namespace (this thread stays where it
    is); what it makes there (a listening socket, a TCPStore's client) stays there."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(netns)
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    thread = threading.Thread(target=run, name=f"netns-{netns}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]  # type: ignore[no-any-return]


def _reno() -> None:
    """The calling thread's namespace's TCP: reno, loss-based (tbf's queue is deep: it backs off
    never and fills the link). The host's default may be BBR, which every 10 s drains its
    window to probe the path's RTT and paces by the bandwidth it measured: over a tbf link its
    steps came out 5 to 15 % slower than their bytes at the rate, and uneven."""
    TCP_CC.write_text("reno")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(args)}: {(done.stderr or done.stdout).strip()}")
    return done


def _no_ipv6(dev: str) -> None:
    """A host-side device of the run without IPv6 (no link-local address, no neighbour
    discovery on the links)."""
    knob = Path("/proc/sys/net/ipv6/conf") / dev / "disable_ipv6"
    if knob.exists():
        knob.write_text("1")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_NAME = re.compile(rf"^{PREFIX}(\d+)(?:br|r\d+|h\d+|n\d+)$")


def run_names() -> tuple[list[str], list[str]]:
    """The namespaces and host links a shaped run made (by name), any launcher's."""
    netns = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()
             if line.split()]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _run("ip", "-o", "link", "show").stdout.splitlines()
             if line.count(":") >= 2]
    return ([n for n in netns if _NAME.match(n)], [n for n in links if _NAME.match(n)])


def remove_leftovers(own_pid: int | None = None) -> list[str]:
    """Remove what shaped runs left whose launcher no longer lives (a kill -9), and this
    launcher's own earlier names (a pid used again); the names removed."""
    own = os.getpid() if own_pid is None else own_pid
    netns, links = run_names()
    removed = []
    for name in links + netns:
        m = _NAME.match(name)
        assert m is not None
        pid = int(m.group(1))
        if pid != own and _alive(pid):
            continue
        if name in netns:
            _run("ip", "netns", "delete", name, check=False)
        else:
            _run("ip", "link", "delete", name, check=False)
        removed.append(name)
    return removed


@dataclass
class ShapedNetwork:
    """The run's bridge, namespaces and shaped links (a context: made on entry, removed on
    exit, whatever ended the run)."""

    cfg: NetworkConfig
    world_size: int
    pid: int = field(default_factory=os.getpid)
    links: list[Link] = field(default_factory=list)
    made: list[tuple[str, str]] = field(default_factory=list)  # ("netns" | "link", name)
    before: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return f"{PREFIX}{self.pid}"

    @property
    def subnet(self) -> str:
        return f"10.{(self.pid >> 8) & 255}.{self.pid & 255}"

    def host_end(self, rank: int) -> str:
        return f"{self.tag}h{rank}"

    def __enter__(self) -> ShapedNetwork:
        remove_leftovers(self.pid)
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _qdisc(self, dev: str, netns: str | None) -> None:
        where = ["-n", netns] if netns else []
        rate = self.cfg.rate
        # a bucket of at least one MTU and 1 ms at the rate; a queue TCP does not overflow
        burst = max(3200, int(rate_bits(rate) / 8 / 1000))
        delay = seconds(self.cfg.delay)
        if delay > 0:  # netem shapes too (its rate), and delays (untested here: no netem)
            _run("tc", *where, "qdisc", "add", "dev", dev, "root", "netem", "delay",
                 f"{delay * 1e6:.0f}us", "rate", rate, "limit", "10000")
        else:
            _run("tc", *where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", str(burst), "limit", str(QUEUE_BYTES))

    def _make(self) -> None:
        bridge = f"{self.tag}br"
        self._add("link", bridge, ["ip", "link", "add", bridge, "type", "bridge"])
        _no_ipv6(bridge)  # no link-local address: the host stays out of the ranks' reach
        _run("ip", "link", "set", bridge, "up")
        for rank in range(self.world_size):
            netns, host, inner = f"{self.tag}r{rank}", self.host_end(rank), f"{self.tag}n{rank}"
            address = f"{self.subnet}.{rank + 1}"
            self._add("netns", netns, ["ip", "netns", "add", netns])
            self._add("link", host, ["ip", "link", "add", host, "type", "veth", "peer", "name",
                                     inner])
            _run("ip", "link", "set", inner, "netns", netns)
            _no_ipv6(host)
            _run("ip", "link", "set", host, "master", bridge, "up")
            _run("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", inner)
            _run("ip", "-n", netns, "link", "set", inner, "up")
            _run("ip", "-n", netns, "link", "set", "lo", "up")
            inside(netns, _reno)
            self._qdisc(host, None)  # toward the rank: what it receives
            self._qdisc(inner, netns)  # from the rank: what it sends
            self.links.append(Link(netns, inner, address))
        self.before = [self.counters(r) for r in range(self.world_size)]

    def _add(self, kind: str, name: str, command: list[str]) -> None:
        done = _run(*command, check=False)
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip()
            if "exists" in why.lower():
                raise NetworkError(f"network=shaped: {kind} {name} already exists (another "
                                   "run's? remove it with ip "
                                   f"{'netns delete' if kind == 'netns' else 'link delete'} "
                                   f"{name})")
            raise NetworkError(f"network=shaped: {' '.join(command)}: {why}")
        self.made.append((kind, name))

    def counters(self, rank: int) -> tuple[int, int]:
        """(bytes the rank sent, bytes it received) so far: its host end's rx and tx."""
        stats = SYS_NET / self.host_end(rank) / "statistics"
        return (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))

    def remove(self) -> None:
        """Every namespace and link this run made (a veth pair goes with either end)."""
        for kind, name in reversed(self.made):
            if kind == "netns":
                _run("ip", "netns", "delete", name, check=False)
            else:
                _run("ip", "link", "delete", name, check=False)
        self.made.clear()

    def section(self, summary: dict[str, Any]) -> dict[str, Any]:
        """summary.json's network section: the link bytes of each rank since the links were
        made, beside what the engine says it sent (read before the links go)."""
        after = [self.counters(r) for r in range(self.world_size)]
        sent = [a[0] - b[0] for a, b in zip(after, self.before, strict=True)]
        received = [a[1] - b[1] for a, b in zip(after, self.before, strict=True)]
        p = self.world_size

        def counted(key: str) -> list[int]:
            value = summary.get(key)
            return value if isinstance(value, list) else [0] * p

        # the groups they run in: a sharded engine's reduce-scatters and all-gathers within a
        # replica (its mesh's shard ranks), HSDP's all-reduces across the replicas; else all
        mesh = (summary.get("engine") or {}).get("mesh") or {}
        shard, across = int(mesh.get("shard", p)), int(mesh.get("replicate", p))

        def ring(nbytes: list[int], group: int, passes: int) -> list[float]:
            return [passes * (group - 1) / group * n for n in nbytes]

        # gloo's reduce-scatter is an all-reduce of the whole buffer, each rank then keeping
        # its chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced): on these links it
        # costs an all-reduce's bytes; its all-gather is a ring's
        parts = [ring(counted("allreduce_bytes"), across, 2),
                 ring(counted("reduce_scatter_bytes"), shard, 2),
                 ring(counted("all_gather_bytes"), shard, 1)]
        engine = [a + b + c for a, b, c in zip(counted("allreduce_bytes"),
                                               counted("reduce_scatter_bytes"),
                                               counted("all_gather_bytes"), strict=True)]
        probed = summary.pop("link_probe", None) or {}  # rank 0's hop_latency()
        return {**asdict(self.cfg), "rate_bits_per_s": self.cfg.rate_bits, **probed,
                "link_sent_bytes": sent, "link_received_bytes": received,
                "engine_bytes": engine,
                # what a ring sends of them: 2(g-1)/g of an all-reduce's bytes (and of gloo's
                # reduce-scatter's), (g-1)/g of an all-gather's, in a group of g ranks
                "ring_bytes": [round(sum(r)) for r in zip(*parts, strict=True)],
                "overhead": OVERHEAD}


def local_section(cfg: NetworkConfig) -> dict[str, Any]:
    return {"name": cfg.name}
