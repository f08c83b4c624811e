"""A real Prometheus for tests: the binaries `make prometheus` unpacks into the venv (or ones on
PATH), a server on 127.0.0.1 with a given configuration in a temporary directory, and its HTTP
API (instant queries, targets) through urllib."""

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.procs import free_port

REPO = Path(__file__).resolve().parents[1]


def binary(name: str) -> str | None:
    """prometheus or promtool: what `make prometheus` unpacked into the checkout's .venv, or
    into the venv running the tests (a worktree may borrow another checkout's), then PATH."""
    for venv in (REPO / ".venv", Path(sys.prefix)):
        local = venv / "prometheus" / "usr" / "bin" / name
        if local.exists():
            return str(local)
    return shutil.which(name)


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    tool = binary("promtool")
    if tool is None:
        raise FileNotFoundError("promtool: run `make prometheus`")
    return subprocess.run(
        [tool, *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


class Prometheus:
    """A Prometheus server scraping with `config` (a dict: prometheus.yml) until stop()."""

    def __init__(self, config: dict[str, Any], timeout: float = 60.0) -> None:
        exe = binary("prometheus")
        if exe is None:
            raise FileNotFoundError("prometheus: run `make prometheus`")
        self.dir = Path(tempfile.mkdtemp(prefix="epcluster-prometheus-"))
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.dir / "log", "w")
        self.proc = subprocess.Popen(
            [
                exe,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.console.templates=/dev/null",
                "--web.console.libraries=/dev/null",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            self.wait_for(self._ready, timeout, "Prometheus to get ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.logs()}") from None
            return False

    def logs(self) -> str:
        self.log.flush()
        return (self.dir / "log").read_text()[-3000:]

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # a bad query: 400 with an error body
            body = json.load(e)
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (ValueError when Prometheus rejects it)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [data]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        end = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > end:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
