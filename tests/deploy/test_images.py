"""The container images' definitions, read (they cannot be built here: no Docker): each installs
torch at a version the project allows, Ray at the version the RayCluster names, then the project,
and runs `epcluster` as a non-root user; the build context keeps what `pip install .` needs."""

import json
import re

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib
from packaging.requirements import Requirement

from tests.deploy.conftest import REPO

DOCKERFILES = ("Dockerfile", "Dockerfile.cpu")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, out, pending = (REPO / "deploy" / name).read_text().splitlines(), [], ""
    for line in lines:
        if line.lstrip().startswith("#") and not pending.endswith("\\"):
            continue
        pending = f"{pending[:-1]} {line.strip()}" if pending.endswith("\\") else line.strip()
        if pending and not pending.endswith("\\"):
            op, _, args = pending.partition(" ")
            out.append((op.upper(), args.strip()))
            pending = ""
    return out


def project_requirement(name: str) -> Requirement:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (req,) = [r for r in map(Requirement, project["dependencies"]) if r.name == name]
    return req


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_the_project_and_runs_epcluster(name):
    ins = instructions(name)
    ops = [op for op, _ in ins]
    assert ops[0] in ("FROM", "ARG") and "FROM" in ops
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    runs = [a for op, a in ins if op == "RUN"]

    torch = [r for r in runs if '"torch==${TORCH_VERSION}"' in r]
    assert torch, "torch is installed pinned, before the project"
    assert project_requirement("torch").specifier.contains(args["TORCH_VERSION"])
    assert project_requirement("ray").specifier.contains(args["RAY_VERSION"])

    copy = [a for op, a in ins if op == "COPY"]
    assert copy == [". /opt/epcluster-src"]
    (install,) = [r for r in runs if "/opt/epcluster-src" in r and "pip install" in r]
    # the CPU kernels build at install, against the pinned torch (setup.py)
    assert "pip install --no-build-isolation /opt/epcluster-src" in install
    assert '"ray[default]==${RAY_VERSION}"' in install  # dashboard agent: KubeRay's probes
    assert runs.index(torch[0]) < runs.index(install)

    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["epcluster"]
    assert dict(ins)["USER"] == "epcluster"
    assert any("useradd" in r and "--uid 1000" in r for r in runs)  # = runAsUser in the pods
    assert any(re.search(r"\bprocps\b", r) for r in runs)  # pgrep in the head's preStop hook


def test_gpu_image_is_cuda_and_cpu_image_is_cpu_only():
    gpu = dict(instructions("Dockerfile"))
    assert "nvidia/cuda:" in next(
        a for op, a in instructions("Dockerfile") if op == "ARG" and "CUDA_IMAGE" in a
    )
    assert gpu["FROM"] == "${CUDA_IMAGE}"
    cpu = instructions("Dockerfile.cpu")
    assert dict(cpu)["FROM"].startswith("python:3.11-slim")
    assert any(
        "--index-url https://download.pytorch.org/whl/cpu" in a for op, a in cpu if op == "RUN"
    )


def test_both_images_pin_the_same_versions():
    gpu, cpu = (
        dict(a.split("=", 1) for op, a in instructions(n) if op == "ARG" and "=" in a)
        for n in DOCKERFILES
    )
    assert gpu["TORCH_VERSION"] == cpu["TORCH_VERSION"]
    assert gpu["RAY_VERSION"] == cpu["RAY_VERSION"]


def test_entrypoint_script_exists():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["epcluster"] == "cluster.cli:main"


def test_dockerignore_keeps_what_pip_install_needs():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".git", ".venv"} <= set(patterns)
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    needed = ["pyproject.toml", "README.md"] + [
        p.rstrip("*") for p in setuptools["packages"]["find"]["include"]
    ]
    for path in needed:
        assert (REPO / path).exists()
        assert not any(path == p or path.startswith(p.rstrip("/") + "/") for p in patterns), path
