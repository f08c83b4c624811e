"""A real multi-node Ray cluster on one Linux machine: each node a network namespace with its own
address on a bridge, `ray start --head` in the first and `ray start --address` in the others
(token authentication on), for tests and `make multinode-demo`. Needs root and iproute2.

The cluster has its own Ray token, Ray temporary directories and torch extensions directory (in
one private directory): it needs no ~/.ray/auth_token and never touches /tmp/ray, so other Ray
clusters on the machine neither see it nor are seen by it.

Everything it creates it deletes in close(), even after a failure: the processes of each
namespace (killed by namespace, never by name: `ray stop` would stop every Ray on the machine),
the namespaces, the veth pairs, the bridge and the private directory; leftovers() says what of
it is still there.
"""

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
SUBNETS = range(100, 200)  # a cluster's nodes are on 10.77.<s>.0/24, one s per cluster
READY = "epcluster: ready on"
BUILD_KERNEL = "from kernels.cpu.build import cpu_kernels; cpu_kernels()"
# GET each URL given, print the bodies as a JSON list (runs inside a node's namespace)
FETCH = (
    "import json, sys, urllib.request as u; "
    "print(json.dumps([u.urlopen(x, timeout=30).read().decode() for x in sys.argv[1:]]))"
)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = f"epchk{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], check=False, timeout=60)
    return None


def _ip(*args: str, check: bool = True) -> str:
    return subprocess.run(
        ["ip", *args], check=check, capture_output=True, text=True, timeout=60
    ).stdout


def _free_subnet() -> int:
    """The first 10.77.<s>.0/24 that no route here uses (another cluster's bridge would)."""
    routes = _ip("-4", "route")
    return next(s for s in SUBNETS if f"10.77.{s}.0/24" not in routes)


def _pids(netns: list[str]) -> list[int]:
    return [int(p) for ns in netns for p in _ip("netns", "pids", ns, check=False).split()]


def _end_processes(netns: list[str], grace_s: float = 3.0) -> None:
    """SIGTERM every process in the namespaces, SIGKILL what is left after grace_s (Ray's GCS,
    raylets and agents outlast a SIGTERM by many seconds; the nodes keep nothing), and wait
    until none is left: a namespace outlives `ip netns del`, links included, while a process
    is still in it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        for pid in _pids(netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + wait_s
        while _pids(netns) and time.monotonic() < end:
            time.sleep(0.2)
        if not _pids(netns):
            return


@dataclass
class Nodes:
    """`resources[i]`: the custom Ray resources node i offers (node 0 is the Ray head)."""

    resources: list[dict[str, float]]
    num_cpus: int = 2
    subnet: int = 0  # 10.77.<subnet>.0/24; 0: the first free one of SUBNETS, at start
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    names: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    dir: Path | None = None  # the token file, each node's Ray temporary directory, builds
    _kernel_built: bool = False

    @property
    def bridge(self) -> str:
        return f"epbr{self.tag}"

    def veth(self, i: int) -> str:
        """The bridge's end of node i's link (the node's end is its eth0)."""
        return f"ep{self.tag}v{i}"

    def addr(self, i: int) -> str:
        return f"10.77.{self.subnet}.{i + 1}"

    @property
    def host_addr(self) -> str:
        """This (the root namespace's) address on the bridge: reaches every node."""
        return f"10.77.{self.subnet}.254"

    @property
    def ray_address(self) -> str:
        return f"{self.addr(0)}:6379"

    @property
    def token_file(self) -> Path:
        """The cluster's Ray authentication token: every node and driver reads it."""
        assert self.dir is not None, "start() first"
        return self.dir / "auth_token"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0")
        env["RAY_AUTH_TOKEN_PATH"] = str(self.token_file)
        env.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # nodes listen on their own address
        env["PYTHONPATH"] = str(REPO)
        env["TORCH_EXTENSIONS_DIR"] = str(self.dir / "torch_extensions")
        return env

    def start(self) -> "Nodes":
        try:
            self.dir = Path(tempfile.mkdtemp(prefix="epcnet-"))  # mode 0700
            self.token_file.write_text(secrets.token_hex(32))
            self.subnet = self.subnet or _free_subnet()
            self._links()
            self._ray_start()
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
            ns = f"ep{self.tag}n{i}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(i), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _in(self, i: int, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *cmd]

    def run(self, i: int, *cmd: str, **kw) -> subprocess.CompletedProcess:
        """Run a command in node i's namespace and wait for it."""
        kw.setdefault("env", self.env())
        kw.setdefault("timeout", 300)
        return subprocess.run(self._in(i, *cmd), **kw)

    def popen(self, i: int, *cmd: str, **kw) -> subprocess.Popen:
        """Start a command in node i's namespace; close() kills it if it is still running."""
        kw.setdefault("env", self.env())
        proc = subprocess.Popen(self._in(i, *cmd), **kw)
        self.procs.append(proc)
        return proc

    def fetch(self, i: int, *urls: str) -> list[str]:
        """GET each URL from node i's namespace (through its link); -> the bodies."""
        out = self.run(i, sys.executable, "-c", FETCH, *urls, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"GET {urls} from node {i} failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def _ray_start(self) -> None:
        """The head, then the other nodes at once; each `ray start` returns once its node runs."""

        def start(i: int) -> subprocess.Popen:
            where = ["--head", "--port", "6379", "--include-dashboard=false"] if i == 0 else [
                "--address", self.ray_address
            ]  # fmt: skip
            cmd = self._in(
                i, RAY, "start", *where, "--node-ip-address", self.addr(i),
                "--num-cpus", str(self.num_cpus), "--resources", json.dumps(self.resources[i]),
                "--temp-dir", str(self.dir / f"ray{i}"), "--disable-usage-stats",
            )  # fmt: skip
            return subprocess.Popen(cmd, env=self.env(), stdout=subprocess.PIPE, text=True,
                                    stderr=subprocess.STDOUT)  # fmt: skip

        def check(i: int, proc: subprocess.Popen) -> None:
            out, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"ray start on node {i} failed:\n{out[-3000:]}")

        check(0, start(0))
        workers = [(i, start(i)) for i in range(1, len(self.resources))]
        for i, proc in workers:
            check(i, proc)

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

    def serve(
        self, i: int, config: dict[str, Any], timeout: float = 300.0, echo: bool = False
    ) -> "Serve":
        """`epcluster serve --config` (config: a ClusterConfig tree, as deploy/config.example.yaml)
        as the Ray driver on node i; -> the running Serve, once it says it is ready. echo: print
        its output as it comes."""
        if not self._kernel_built:
            self._build_kernel(i)
        path = self.dir / f"serve-{len(self.procs)}.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = self.popen(
            i, sys.executable, "-m", "cluster.cli", "serve", "--config", str(path), cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        return Serve(proc, echo).wait_ready(timeout)

    def _build_kernel(self, i: int) -> None:
        """Build the ranks' CPU kernel (kernels/cpu/build.py) into the cluster's own torch
        extensions directory before any rank needs it. NOTE: a rank that builds it in its first
        decode step stalls past health.stall_timeout_s on a busy machine and is killed mid-build,
        leaving torch's build lock for every later process to wait on; and the machine's shared
        directory is rebuilt whenever another checkout of the repo loads the kernel."""
        out = self.run(i, sys.executable, "-c", BUILD_KERNEL, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"building the CPU kernel failed:\n{out.stderr[-3000:]}")
        self._kernel_built = True

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        _end_processes(self.names)  # every process left in them: Ray's, the ranks
        for i, ns in enumerate(self.names):
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", self.veth(i), check=False)  # usually gone with the namespace
        _ip("link", "del", self.bridge, check=False)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.names = []

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, links, processes (whose command
        line names the private directory: every Ray process of it does), the directory."""
        tag = f"ep{self.tag}"
        left = [f"netns {n}" for n in _ip("netns", "list").split() if n.startswith(tag)]
        for line in _ip("-o", "link").splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(tag) or name == self.bridge:
                left.append(f"link {name}")
        if self.dir is not None:
            mark = str(self.dir).encode()
            for pid in filter(str.isdigit, os.listdir("/proc")):
                with contextlib.suppress(OSError):
                    if mark in Path(f"/proc/{pid}/cmdline").read_bytes():
                        left.append(f"process {pid}")
            if self.dir.exists():
                left.append(f"directory {self.dir}")
        return left

    def __enter__(self) -> "Nodes":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class Serve:
    """A running `epcluster serve`: its output read as it comes (a full pipe would block it)."""

    def __init__(self, proc: subprocess.Popen, echo: bool = False) -> None:
        self.proc, self.echo = proc, echo
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.echo:
                print("  serve |", line.rstrip(), flush=True)
            if READY in line:
                self.ready.set()

    def output(self, last: int = 50) -> str:
        return "".join(self.lines[-last:])

    def wait_ready(self, timeout: float) -> "Serve":
        end = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"epcluster serve did not become ready:\n{self.output()}")
        return self

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (the router drains, the ranks stop); -> its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise
