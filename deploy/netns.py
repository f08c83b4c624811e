"""A real multi-node Ray cluster on one Linux machine: each node a network namespace with its own
address on a bridge, `ray start --head` in the first and `ray start --address` in the others
(token authentication on), for tests and `make multinode-demo`. Needs root and iproute2.

Everything it creates it deletes in close(), even after a failure: the processes of each
namespace (killed by namespace, never by name: `ray stop` would stop every Ray on the machine),
the namespaces, the veth pairs and the bridge.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = f"epchk{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Nodes:
    """`resources[i]`: the custom Ray resources node i offers (node 0 is the Ray head)."""

    resources: list[dict[str, float]]
    num_cpus: int = 2
    subnet: int = field(default_factory=lambda: 100 + os.getpid() % 100)  # 10.77.<subnet>.0/24
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    names: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"epbr{self.tag}"

    def addr(self, i: int) -> str:
        return f"10.77.{self.subnet}.{i + 1}"

    @property
    def host_addr(self) -> str:
        """This (the root namespace's) address on the bridge: reaches every node."""
        return f"10.77.{self.subnet}.254"

    @property
    def ray_address(self) -> str:
        return f"{self.addr(0)}:6379"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # nodes listen on their own address
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        return env

    def start(self) -> "Nodes":
        try:
            self._links()
            for i, resources in enumerate(self.resources):
                self._ray_start(i, resources)
            self.wait_for_nodes(len(self.resources))
            return self
        except BaseException:
            self.close()
            raise

    def _links(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(len(self.resources)):
            ns, veth = f"ep{self.tag}n{i}", f"ep{self.tag}v{i}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run(self, i: int, *cmd: str, **kw) -> subprocess.CompletedProcess:
        """Run a command in node i's namespace and wait for it."""
        kw.setdefault("env", self.env())
        kw.setdefault("timeout", 300)
        return subprocess.run(["ip", "netns", "exec", self.names[i], *cmd], **kw)

    def popen(self, i: int, *cmd: str, **kw) -> subprocess.Popen:
        """Start a command in node i's namespace; close() kills it if it is still running."""
        kw.setdefault("env", self.env())
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], **kw)
        self.procs.append(proc)
        return proc

    def _ray_start(self, i: int, resources: dict[str, float]) -> None:
        import json

        where = ["--head", "--port", "6379", "--include-dashboard=false"] if i == 0 else [
            "--address", self.ray_address
        ]  # fmt: skip
        out = self.run(
            i, RAY, "start", *where, "--node-ip-address", self.addr(i),
            "--num-cpus", str(self.num_cpus), "--resources", json.dumps(resources),
            "--disable-usage-stats", capture_output=True, text=True,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"ray start on node {i} failed: {out.stdout[-2000:]}{out.stderr}")

    def wait_for_nodes(self, n: int, timeout: float = 120.0) -> None:
        script = (
            f"import ray; ray.init(address={self.ray_address!r}); "
            "print(len([x for x in ray.nodes() if x['Alive']]))"
        )
        end = time.monotonic() + timeout
        while True:
            out = self.run(0, sys.executable, "-c", script, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"{n} Ray nodes did not join: {out.stdout}{out.stderr}")
            time.sleep(1)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for ns in self.names:  # every process left in the namespace: Ray's, the ranks
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
                for pid in pids.stdout.split():
                    try:
                        os.kill(int(pid), sig)
                    except ProcessLookupError:
                        pass
                if sig == signal.SIGTERM and pids.stdout.split():
                    time.sleep(2)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        # `ray start --head` left its address for `ray.init()` without one to find: remove it
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        with contextlib.suppress(OSError):
            if current.read_text().strip() == self.ray_address:
                current.unlink()
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
        self.names = []

    def __enter__(self) -> "Nodes":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
