"""A throwaway redis-server for tests: loopback port, temp dir, no persistence.

server = RedisServer()       # started; answers PING
server.url                   # redis://127.0.0.1:PORT/0
server.unix_url              # unix:///tmp/.../redis.sock?db=0
server.stop(); server.start()  # same port and socket, empty data
server.close()               # stop and remove the temp dir
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import redis

REDIS_SERVER = os.environ.get("REDIS_SERVER", shutil.which("redis-server") or "redis-server")


def stop_process(proc: subprocess.Popen | None, grace: float = 5.0) -> None:
    """SIGTERM a server process, SIGKILL it if it is still there after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Runs ``redis-server`` on a free loopback port (and a unix socket) in a temp dir."""

    def __init__(self, port: int | None = None, start: bool = True) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="mlxcache-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc: subprocess.Popen | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self, timeout: float = 10.0) -> None:
        """Start the server (if stopped) and wait until it answers PING."""
        if self.running:
            return
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", self.socket,
            "--unixsocketperm", "700",
            "--dir", self.dir,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", os.path.join(self.dir, "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.client(socket_timeout=1, socket_connect_timeout=1) as c:
                    if c.ping():
                        return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); the port is free again afterwards."""
        stop_process(self.proc)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
