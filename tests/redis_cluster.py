"""Throwaway Redis Cluster and Sentinel deployments for tests: real redis-server processes.

cluster = LocalCluster()            # 3 primaries + 3 replicas on free loopback ports, state ok
cluster.url                         # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/
node = cluster.kill_primary()       # SIGKILL one primary; waits until its replica took over
cluster.heal()                      # restart killed nodes (they rejoin as replicas), state ok
cluster.close()

sentinel = LocalSentinel()          # 1 primary, 1 replica, 3 sentinels watching "mymaster"
sentinel.url                        # redis+sentinel://127.0.0.1:S1,.../mymaster/0
sentinel.failover()                 # SIGKILL the primary; waits until the replica is promoted
sentinel.heal()                     # restart the old primary (the sentinels make it a replica)
with sentinel.no_failover(): ...    # the sentinels judge nothing down inside the block
sentinel.close()

Timeouts are small (cluster-node-timeout and down-after-milliseconds 1 s; pass others) so
start-up and failover take a few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from redis_server import REDIS_SERVER, free_port, stop_process

REDIS_CLI = os.environ.get("REDIS_CLI", shutil.which("redis-cli") or "redis-cli")
NODE_TIMEOUT_MS = 1000  # short for fast failovers, long enough for a loaded 2-core machine
DOWN_AFTER_MS = 1000
SERVICE = "mymaster"


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``check`` until it is true; raise naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


class Node:
    """One redis-server process (a cluster node, a plain server or a sentinel) in its own dir."""

    def __init__(self, root: str, name: str, extra: list[str], config: str | None = None) -> None:
        self.port = free_port()
        self.name = name
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.extra = extra
        self.config = config
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [REDIS_SERVER]
        if self.config is not None:  # sentinels rewrite their config file: it must be theirs
            path = os.path.join(self.dir, "sentinel.conf")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write(self.config.format(port=self.port, dir=self.dir))
            args += [path, "--sentinel"]
        args += [
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.dir,
            "--logfile", os.path.join(self.dir, "redis.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.config is None:
            args += ["--save", "", "--appendonly", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        wait_for(f"{self.name} to answer PING", lambda: self.running and self.client().ping(), 10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2
        )

    def info(self, section: str) -> dict:
        with self.client() as c:
            return c.info(section)

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crashed machine would."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""


class _Deployment:
    nodes: list[Node]

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="mlxcache-rdeploy-")
        self.nodes = []

    def _start_all(self) -> None:
        try:
            for n in self.nodes:
                n.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalCluster(_Deployment):
    """A Redis Cluster of ``primaries`` primaries with one replica each, built by redis-cli."""

    def __init__(self, primaries: int = 3, node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        super().__init__()
        for i in range(2 * primaries):
            bus = free_port()
            self.nodes.append(
                Node(
                    self.root,
                    f"node{i}",
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                        "--cluster-port",
                        str(bus),
                        "--cluster-replica-validity-factor",
                        "0",
                        "--appendonly",
                        "no",
                    ],
                )  # fmt: skip
            )
        self._start_all()
        try:
            subprocess.run(
                [REDIS_CLI, "--cluster", "create"]
                + [f"127.0.0.1:{n.port}" for n in self.nodes]
                + ["--cluster-replicas", "1", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    @property
    def seeds(self) -> list[Node]:
        """The nodes named in :attr:`url` (the first half; any node works as a seed)."""
        return self.nodes[: len(self.nodes) // 2]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.seeds) + "/"

    def primaries(self) -> list[Node]:
        return [n for n in self.nodes if n.running and n.info("replication")["role"] == "master"]

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Every running node says cluster_state:ok, and every primary has a synced replica."""
        running = [n for n in self.nodes if n.running]

        def ok() -> bool:
            for n in running:
                with n.client() as c:
                    if c.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                        return False
            primaries = self.primaries()
            if len(primaries) * 2 != len(running):
                return False
            for n in running:
                repl = n.info("replication")
                if repl["role"] == "slave" and repl.get("master_link_status") != "up":
                    return False
                if repl["role"] == "master" and repl.get("connected_slaves", 0) < 1:
                    return False
            return True

        wait_for("the cluster to be healthy", ok, timeout)

    def flushall(self) -> None:
        for n in self.primaries():
            with n.client() as c:
                c.flushall()

    def kill_primary(self, index: int = 0) -> Node:
        """SIGKILL the ``index``-th primary and wait until its replica is promoted."""
        victim = self.primaries()[index]
        with victim.client() as c:
            myid = c.execute_command("CLUSTER MYID")
            myid = myid.decode() if isinstance(myid, bytes) else myid
        replicas = [
            n
            for n in self.nodes
            if n.running and n.info("replication").get("master_port") == victim.port
        ]
        victim.kill()

        def promoted() -> bool:
            if not any(r.info("replication")["role"] == "master" for r in replicas):
                return False
            for n in self.nodes:
                if n.running:
                    with n.client() as c:
                        if c.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                            return False
            return True

        wait_for(f"a replica of {victim.name} ({myid}) to be promoted", promoted)
        return victim

    def heal(self) -> None:
        """Restart killed nodes (they rejoin as replicas of the promoted ones); wait until ok."""
        for n in self.nodes:
            if not n.running:
                n.start()
        self.wait_healthy()


SENTINEL_CONF = """\
port {{port}}
bind 127.0.0.1
dir {{dir}}
logfile "{{dir}}/redis.log"
sentinel monitor {service} 127.0.0.1 {primary} 2
sentinel down-after-milliseconds {service} {down}
sentinel failover-timeout {service} 5000
sentinel parallel-syncs {service} 1
"""


class LocalSentinel(_Deployment):
    """One primary, one replica and three sentinels monitoring them as :data:`SERVICE`."""

    def __init__(self, down_after_ms: int = DOWN_AFTER_MS) -> None:
        super().__init__()
        self.down_after_ms = down_after_ms
        self.primary = Node(self.root, "primary", [])
        self.replica = Node(self.root, "replica", [])
        self.replica.extra = ["--replicaof", "127.0.0.1", str(self.primary.port)]
        conf = SENTINEL_CONF.format(service=SERVICE, primary=self.primary.port, down=down_after_ms)
        self.sentinels = [Node(self.root, f"sentinel{i}", [], config=conf) for i in range(3)]
        self.nodes = [self.primary, self.replica, *self.sentinels]
        self._start_all()
        try:
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def master_port(self) -> int:
        """The primary's port as the sentinels see it (the same on all of them)."""
        seen = set()
        for s in self.sentinels:
            with s.client() as c:
                host, port = c.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", SERVICE)
                seen.add(int(port))
        if len(seen) != 1:
            raise redis.RedisError(f"sentinels disagree on the primary: {seen}")
        return seen.pop()

    def current_primary(self) -> Node:
        port = self.master_port()
        return next(n for n in (self.primary, self.replica) if n.port == port)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """All sentinels know each other and the replica, and the replica is in sync."""

        def ok() -> bool:
            primary = self.current_primary()
            for s in self.sentinels:
                with s.client() as c:
                    m = c.execute_command("SENTINEL MASTER", SERVICE)
                    m = dict(zip(m[::2], m[1::2], strict=True)) if isinstance(m, list) else m
                    m = {
                        (k.decode() if isinstance(k, bytes) else k): v.decode()
                        if isinstance(v, bytes)
                        else v
                        for k, v in m.items()
                    }
                    if "s_down" in m["flags"] or "o_down" in m["flags"]:
                        return False
                    if int(m["num-other-sentinels"]) < 2 or int(m["num-slaves"]) < 1:
                        return False
            other = self.replica if primary is self.primary else self.primary
            repl = other.info("replication")
            return repl["role"] == "slave" and repl.get("master_link_status") == "up"

        wait_for("the sentinels to agree", ok, timeout)

    def failover(self) -> Node:
        """SIGKILL the current primary; wait until the sentinels promoted the other server."""
        old = self.current_primary()
        new = self.replica if old is self.primary else self.primary
        old.kill()

        def promoted() -> bool:
            return self.master_port() == new.port and new.info("replication")["role"] == "master"

        wait_for("the sentinels to promote the replica", promoted)
        return old

    @contextmanager
    def no_failover(self) -> Iterator[None]:
        """Inside the block the sentinels judge no server down (down-after-milliseconds is an
        hour), so stopping both servers tests the clients alone: a failover started while the
        replica is stopped too can leave the sentinels without a primary for minutes."""
        self._set_down_after(3_600_000)
        try:
            yield
        finally:
            self._set_down_after(self.down_after_ms)

    def _set_down_after(self, ms: int) -> None:
        for s in self.sentinels:
            with s.client() as c:
                c.execute_command("SENTINEL SET", SERVICE, "down-after-milliseconds", str(ms))

    def heal(self) -> None:
        """Restart a killed server as a replica of the current primary (as its rewritten config
        would say; the sentinels would also convert it, but only after several seconds)."""
        port = self.master_port()
        for n in (self.primary, self.replica):
            if not n.running:
                n.extra = ["--replicaof", "127.0.0.1", str(port)]
                n.start()
        self.wait_healthy()
