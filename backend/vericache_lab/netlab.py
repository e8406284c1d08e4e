"""A real shaped network on one machine (root): three network namespaces joined by veth pairs,
each pair shaped with ``tc netem``, and each link measured (TCP throughput and round trip) so the
shaping is shown, not assumed.

    vc-draft ==slow== vc-store      the drafter reaches the store over the slow link
    vc-draft ==slow== vc-verify     ... and the verifier
    vc-verify ==fast== vc-store     the verifier sits next to the store

Every link's rate is shaped with ``tc tbf`` on both ends. This kernel has no ``sch_netem``, so a
slow link's round trip is added by a delay relay (``remote.relay``, half the round trip each way)
in the server's namespace, in front of the service; the fast link has no relay. Services listen
on 127.0.0.1 of their namespace at the ``SERVICE_PORTS``; ``endpoints`` says where each client
reaches them. Where namespaces cannot be made (not root, no ``ip``), ``available()`` says why; callers stop
with that reason rather than fall back to loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

NAMESPACES = {"draft": "vc-draft", "store": "vc-store", "verify": "vc-verify"}
SERVICE_PORTS = {"store": 6379, "verify": 50051}
RELAY_PORT_OFFSET = 1          # the delay relay of a service on port p listens on p + 1
RUN_DIR = "/run/vericache-netlab"
# link name -> (side a, side b, subnet prefix, kind)
LINKS = {"slow-store": ("draft", "store", "10.77.1", "slow"),
         "slow-verify": ("draft", "verify", "10.77.2", "slow"),
         "fast": ("verify", "store", "10.77.3", "fast")}


@dataclass
class Shape:
    slow_gbps: float = 1.0
    rtt_ms: float = 20.0
    fast_gbps: float = 25.0

    def __post_init__(self) -> None:
        for name in ("slow_gbps", "fast_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.rtt_ms >= 0:
            raise ValueError(f"rtt_ms must be >= 0, got {self.rtt_ms!r}")


@dataclass
class Lab:
    shape: Shape

    @property
    def addresses(self) -> dict:
        """Where each side reaches the other: {"store": {"from_draft": ip, "from_verify": ip}, ...}."""
        out: dict = {}
        for a, b, net, _ in LINKS.values():
            out.setdefault(b, {})[f"from_{a}"] = f"{net}.2"
            out.setdefault(a, {})[f"from_{b}"] = f"{net}.1"
        return out

    @property
    def endpoints(self) -> dict:
        """host:port where each client reaches each service (through the relay on slow links)."""
        a = self.addresses
        return {"store_from_draft": f"{a['store']['from_draft']}:{SERVICE_PORTS['store'] + RELAY_PORT_OFFSET}",
                "store_from_verify": f"{a['store']['from_verify']}:{SERVICE_PORTS['store']}",
                "verifier_from_draft": f"{a['verify']['from_draft']}:{SERVICE_PORTS['verify'] + RELAY_PORT_OFFSET}"}


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def exec_in(role: str, *cmd: str) -> list[str]:
    """The command line running ``cmd`` inside ``role``'s namespace."""
    return ["ip", "netns", "exec", NAMESPACES[role], *cmd]


def available() -> str | None:
    """None when namespaces can be made here; otherwise why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in CI which runs as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands are not installed (Debian package iproute2: apt-get install -y iproute2)"
    probe = "vc-probe"
    r = _sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def down() -> None:
    if os.path.isdir(RUN_DIR):
        for name in os.listdir(RUN_DIR):
            try:
                os.kill(int(open(os.path.join(RUN_DIR, name)).read()), 15)
            except (ValueError, OSError):
                pass
            os.unlink(os.path.join(RUN_DIR, name))
    for ns in NAMESPACES.values():
        _sh("ip", "netns", "del", ns, check=False)  # deleting a namespace deletes its veth ends


def up(shape: Shape) -> Lab:
    reason = available()
    if reason:
        raise RuntimeError(f"netlab: {reason}")
    down()
    for ns in NAMESPACES.values():
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    for name, (a, b, net, kind) in LINKS.items():
        ends = [(a, f"{name}-{a}"[:15], f"{net}.1"), (b, f"{name}-{b}"[:15], f"{net}.2")]
        _sh("ip", "link", "add", ends[0][1], "netns", NAMESPACES[a], "type", "veth",
            "peer", "name", ends[1][1], "netns", NAMESPACES[b])
        for role, dev, ip in ends:
            ns = NAMESPACES[role]
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            rate = (shape.slow_gbps if kind == "slow" else shape.fast_gbps) * 1e9 / 8      # bytes/s
            burst = max(int(rate / 250), 256 << 10)                                       # 4 ms worth
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{int(rate * 8)}bit", "burst", str(burst), "latency", "100ms")
    lab = Lab(shape)
    os.makedirs(RUN_DIR, exist_ok=True)
    for role in ("store", "verify"):  # the slow links' delay, in front of each service
        slow_relay(lab, role, SERVICE_PORTS[role])
    return lab


def slow_relay(lab: Lab, role: str, port: int) -> str:
    """A delay relay in ``role``'s namespace in front of its service on 127.0.0.1:``port``, listening on
    the drafter's side of the slow link at port + RELAY_PORT_OFFSET (stopped by ``down``); returns
    that host:port. ``up`` starts one per service; a store cluster needs one per node."""
    listen = f"{lab.addresses[role]['from_draft']}:{port + RELAY_PORT_OFFSET}"
    proc = subprocess.Popen(exec_in(role, sys.executable, "-m", "vericache.remote.relay", listen,
                                    f"127.0.0.1:{port}", str(lab.shape.rtt_ms / 2)),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    proc.stdout.readline()  # "ready"
    with open(os.path.join(RUN_DIR, f"relay-{role}-{port}.pid"), "w") as f:
        f.write(str(proc.pid))
    return listen


def status() -> dict:
    present = set(_sh("ip", "netns", "list", check=False).stdout.split())
    out = {}
    for role, ns in NAMESPACES.items():
        if ns not in present:
            out[role] = None
            continue
        qd = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", check=False).stdout
        out[role] = [line for line in qd.splitlines() if "tbf" in line]
    return out


def link_bytes() -> dict:
    """Bytes each link has carried so far (both directions, counted at its first end)."""
    out = {}
    for name, (a, _, _, _) in LINKS.items():
        dev = f"{name}-{a}"[:15]
        r = _sh("ip", "netns", "exec", NAMESPACES[a], "cat", f"/sys/class/net/{dev}/statistics/rx_bytes",
                f"/sys/class/net/{dev}/statistics/tx_bytes")
        out[name] = sum(int(x) for x in r.stdout.split())
    return out


def measure(lab: Lab, slow_bytes: int = 25 << 20, fast_bytes: int = 200 << 20) -> dict:
    """Each link's TCP throughput (one stream) and round trip, measured across it the way the
    services are reached (slow links through their delay relay). Run before the services start:
    the probe listens on the service's port."""
    ep = lab.endpoints
    paths = {"slow-store": ("draft", "store", ep["store_from_draft"], SERVICE_PORTS["store"], slow_bytes),
             "slow-verify": ("draft", "verify", ep["verifier_from_draft"], SERVICE_PORTS["verify"], slow_bytes),
             "fast": ("verify", "store", ep["store_from_verify"], SERVICE_PORTS["store"], fast_bytes)}
    out = {}
    for name, (client, server_role, target, port, nbytes) in paths.items():
        bind = "127.0.0.1" if name != "fast" else target.rsplit(":", 1)[0]
        server = subprocess.Popen(exec_in(server_role, sys.executable, "-m", "vericache_lab.netprobe", "serve",
                                          bind, str(port)), stdout=subprocess.PIPE, text=True)
        server.stdout.readline()  # "ready"
        host, p = target.rsplit(":", 1)
        r = _sh(*exec_in(client, sys.executable, "-m", "vericache_lab.netprobe", "send", host, p, str(nbytes)))
        server.wait(timeout=60)
        kind = LINKS[name][3]
        out[name] = {"kind": kind, "shaped_gbps": lab.shape.slow_gbps if kind == "slow" else lab.shape.fast_gbps,
                     "shaped_rtt_ms": lab.shape.rtt_ms if kind == "slow" else 0.0, **json.loads(r.stdout)}
    return out
