"""Throw-away redis-server processes on free loopback ports (for tests, benchmarks and
trying the shared tier on one machine). Needs Debian's ``redis-server`` (and
``redis-cli`` for a cluster)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

from percache_core.errors import missing_dependency

try:
    import redis
except ImportError as error:  # pragma: no cover - the redis extra is missing
    raise missing_dependency("redis", "percache-core[redis]") from error


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port; with *cluster_bus*, one whose port + 10000 (Redis Cluster's
    bus port) is free and valid too."""
    if not cluster_bus:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]
    for port in random.sample(range(20000, 55000), 2000):
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def wait_for_ping(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if redis.Redis(port=port, socket_timeout=0.2).ping():
                return
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not start")


class RedisServer:
    """One redis-server process without persistence, on 127.0.0.1."""

    def __init__(self, folder: Path, port: int | None = None, *, cluster: bool = False) -> None:
        self.folder = folder
        self.port = port or free_port(cluster_bus=cluster)
        self.cluster = cluster
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.folder),
        ]
        if self.cluster:
            command += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_ping(self.port)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_cluster(folder: Path, nodes: int = 3) -> list[RedisServer]:
    """A Redis Cluster of *nodes* masters (no replicas)."""
    servers = [RedisServer(folder / f"node{i}", cluster=True).start() for i in range(nodes)]
    subprocess.run(
        [
            shutil.which("redis-cli") or "redis-cli",
            "--cluster",
            "create",
            *[f"127.0.0.1:{s.port}" for s in servers],
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=60,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = redis.Redis(port=servers[0].port).cluster("info")
        if str(info.get("cluster_state") if isinstance(info, dict) else info).find("ok") >= 0:
            return servers
        time.sleep(0.1)
    raise RuntimeError("the test Redis Cluster did not become ready")
