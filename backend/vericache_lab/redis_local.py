"""Redis on this machine for tests and benches: a Redis Cluster of real ``redis-server`` processes on
127.0.0.1 (``LocalRedisCluster``), started, failed over and stopped."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedisCluster:
    """A real Redis Cluster on this machine: ``masters`` masters with ``replicas`` replicas each
    (redis-server --cluster-enabled, joined by ``redis-cli --cluster create``), no persistence, a
    one-second node timeout so a killed master's replica takes over in a few seconds. Nodes listen on
    127.0.0.1 and on ``host``, the address they announce in the slot map (a network namespace's link,
    ``bench prefix --store cluster``)."""

    def __init__(self, tmp_dir, masters: int = 3, replicas: int = 1, host: str = "127.0.0.1") -> None:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            raise RuntimeError("a local Redis Cluster needs redis-server and redis-cli (apt-get install redis-server)")
        self.procs: dict[int, subprocess.Popen] = {}
        self.commands: dict[int, list[str]] = {}   # each node's command line: ``restart`` runs it again
        self.n_masters = masters
        if masters < 1 or replicas < 0:
            raise ValueError(f"a cluster needs masters >= 1 and replicas >= 0, got {masters} and {replicas}")
        self._exe, self._tmp_dir = exe, Path(tmp_dir)
        self._binds, self._host = ["127.0.0.1"] + ([host] if host != "127.0.0.1" else []), host
        for _ in range(masters * (1 + replicas)):
            self._start_node()
        done = subprocess.run([cli, "--cluster", "create", *(f"{host}:{p}" for p in self.procs),
                               "--cluster-replicas", str(replicas), "--cluster-yes"], capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-1000:]} {done.stderr[-1000:]}")
        self.wait_ok()
        # a replica takes over only with a recent copy of its master: wait for every link to be up
        replicas = [n["port"] for n in self.nodes() if "slave" in n["flags"]]
        self.wait_synced(replicas)
        self.url = f"redis://{host}:{self.live()[0]}"

    def _start_node(self, tries: int = 5) -> None:
        """One node on two free ports, up and answering PING. A port found free can be taken before
        redis-server binds it (another test's server, a client's ephemeral port): the node then exits at
        once, and is started again on fresh ports rather than waited on."""
        import redis

        for _ in range(tries):
            port, bus = free_port(), free_port()
            if port == bus:
                continue
            node_dir = self._tmp_dir / f"node-{port}"
            node_dir.mkdir(exist_ok=True)
            command = [self._exe, "--port", str(port), "--cluster-port", str(bus), "--bind", *self._binds,
                       "--cluster-announce-ip", self._host, "--protected-mode", "no",
                       "--save", "", "--appendonly", "no", "--dir", str(node_dir), "--logfile", "redis.log",
                       "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                       "--cluster-node-timeout", "1000"]
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # ours once the server on the port names our process (another test's server could answer PING)
            self._wait(lambda: proc.poll() is not None
                       or redis.Redis(port=port, socket_timeout=1, retry=None).info("server")["process_id"] == proc.pid,
                       f"redis-server on port {port} did not start (log: {node_dir / 'redis.log'})")
            if proc.poll() is None:
                self.procs[port], self.commands[port] = proc, command
                return
        self.stop()
        log = (node_dir / "redis.log").read_text()[-500:] if (node_dir / "redis.log").exists() else ""
        raise RuntimeError(f"redis-server exited at start {tries} times, on fresh ports each time: {log}")

    def wait_synced(self, replicas: list[int]) -> None:
        """Until each of ``replicas`` (ports) has its link to its master up (a full copy received)."""
        import redis

        self._wait(lambda: all(redis.Redis(port=p).info("replication").get("master_link_status") == "up"
                               for p in replicas), f"the replicas {replicas} did not sync with their masters")

    @staticmethod
    def _wait(ready, why: str, timeout_s: float = 30.0) -> None:
        deadline = time.time() + timeout_s
        while True:
            try:
                if ready():
                    return
            except Exception:   # not up yet (connection refused, cluster still forming)
                pass
            if time.time() > deadline:
                raise RuntimeError(why)
            time.sleep(0.1)

    def live(self) -> list[int]:
        return [port for port, proc in self.procs.items() if proc.poll() is None]

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as a live node sees it: port, role flags, whether it serves slots."""
        import redis

        out = []
        for line in redis.Redis(port=self.live()[0]).execute_command("CLUSTER", "NODES").decode().splitlines():
            f = line.split()
            out.append({"port": int(f[1].split("@")[0].rsplit(":", 1)[1]), "flags": f[2].split(","),
                        "slots": len(f) > 8})
        return out

    def masters(self) -> list[int]:
        """Ports of the live masters serving slots."""
        live = set(self.live())
        return sorted(n["port"] for n in self.nodes() if "master" in n["flags"] and "fail" not in n["flags"]
                      and n["slots"] and n["port"] in live)

    def wait_ok(self) -> None:
        """Until every live node reports the cluster ok with all its masters serving their slots (after a
        master's death: once its replica has taken over)."""
        import redis

        def ok() -> bool:
            return all(b"cluster_state:ok" in redis.Redis(port=p).execute_command("CLUSTER", "INFO")
                       for p in self.live()) and len(self.masters()) == self.n_masters
        self._wait(ok, "the cluster did not reach cluster_state:ok")

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def restart(self, port: int) -> None:
        """A killed node started again on its port and folder: its nodes.conf makes it rejoin, as a replica
        of the master that took its slots; returns once it has synced with that master."""
        import redis

        if self.procs[port].poll() is None:
            raise ValueError(f"node {port} is running; kill it first")
        self.procs[port] = subprocess.Popen(self.commands[port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait(lambda: redis.Redis(port=port).info("replication").get("role") == "slave",
                   f"node {port} did not rejoin as a replica")
        self.wait_synced([port])

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    """``python -m vericache_lab.redis_local --host IP --masters 3 --replicas 0 DIR``: a cluster started in
    this process's network namespace; prints its masters' ports as one JSON line, runs until SIGTERM
    (or stdin closes), then stops its nodes (``bench prefix --store cluster`` starts it in vc-store)."""
    import argparse
    import json
    import signal
    import sys

    p = argparse.ArgumentParser(prog="python -m vericache_lab.redis_local")
    p.add_argument("dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--masters", type=int, default=3)
    p.add_argument("--replicas", type=int, default=1)
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with LocalRedisCluster(a.dir, a.masters, a.replicas, a.host) as nodes:
        print(json.dumps({"masters": nodes.masters(), "host": a.host}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
