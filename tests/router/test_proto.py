"""The committed generated code is what router/proto/generate.sh produces, byte for byte."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ["epcluster_pb2.py", "epcluster_pb2_grpc.py", "epcluster_pb2.pyi"]


def test_generate_sh_reproduces_the_committed_files(tmp_path):
    pytest.importorskip("grpc_tools")
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(ROOT / "router/proto/generate.sh"), str(tmp_path)],
        check=True,
        env=env,
        timeout=120,
    )
    for name in GENERATED:
        fresh = (tmp_path / "router/proto" / name).read_bytes()
        committed = (ROOT / "router/proto" / name).read_bytes()
        assert fresh == committed, f"router/proto/{name} is stale: run `make proto`"


def test_generated_code_imports_package_relative():
    text = (ROOT / "router/proto/epcluster_pb2_grpc.py").read_text()
    assert "from router.proto import epcluster_pb2" in text
    assert "\nimport epcluster_pb2" not in text
