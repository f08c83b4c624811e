"""`epcluster serve` as operators run it: on SIGTERM (what Kubernetes sends) the router stops
admitting, lets the stream in flight finish, then stops everything and exits 0."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine import SamplingParams
from router.client import InferenceClient
from router.proto import epcluster_pb2 as pb
from tests.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_the_streams_in_flight():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    serve = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)]
        + ["--prefill-ranks", "1", "--decode-ranks", "1", "--drain-timeout", "120"]
        + ["--metrics-port", "0", "--rank-metrics-port", "0", "--http-port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        for line in serve.stdout:
            lines.append(line)
            if "epcluster: ready on" in line:
                break
        assert serve.poll() is None, "".join(lines)
        with InferenceClient(f"127.0.0.1:{port}", timeout=300) as client:
            params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)
            stream = client.generate([5, 6, 7], params)
            got = list(next(stream).token_ids)
            serve.send_signal(signal.SIGTERM)
            for line in serve.stdout:  # the router has begun draining
                lines.append(line)
                if "draining" in line:
                    break
            with pytest.raises(grpc.RpcError) as refused:  # no new request is admitted
                client.complete([8, 9], SamplingParams(max_tokens=2), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            messages = list(stream)  # ... but the one in flight runs to its end
            got += sum((list(m.token_ids) for m in messages), [])
            assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(got) == 300
        lines += serve.stdout.readlines()
        assert serve.wait(120) == 0, "".join(lines)
        assert "epcluster: stopped" in "".join(lines)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        time.sleep(0.1)
