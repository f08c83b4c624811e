"""bench.common.record: every result file says what ran where, and no run of another command
overwrites it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.delenv("EPCLUSTER_BENCH_NOTE", raising=False)
    return tmp_path


def run_as(monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(common.REPO / "bench" / "eplb.py"), *argv])


def test_record_writes_the_provenance_beside_the_result(
    results: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_as(monkeypatch, "--layers", "2")
    monkeypatch.setenv("EPCLUSTER_BENCH_NOTE", "contended: tests ran beside it")
    path = common.record("x", {"ratio": 1.5})
    out = json.loads(path.read_text())
    assert path == results / "x.json"
    assert out["ratio"] == 1.5 and out["note"] == "contended: tests ran beside it"
    assert out["command"] == ".venv/bin/python -m bench.eplb --layers 2"
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=common.REPO, capture_output=True, text=True
    ).stdout.strip()
    assert out["commit"].split()[0] == head and len(head) == 40
    assert out["date"].endswith(" UTC") and len(out["date"]) == len("2026-11-27 03:00:00 UTC")
    assert out["cores"] >= 1 and out["cpu"] and len(out["load_average"]) == 3
    flags = Path("/proc/cpuinfo").read_text().split()
    assert ("avx2" in out["cpu_flags"]) == ("avx2" in flags)
    assert "torch threads" in out["machine"]


def test_another_command_gets_a_new_file_and_the_same_command_replaces_its_own(
    results: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_as(monkeypatch, "--layers", "2")
    first = common.record("x", {"v": 1})
    run_as(monkeypatch, "--layers", "3")
    second = common.record("x", {"v": 2})
    third = common.record("x", {"v": 3})
    run_as(monkeypatch, "--layers", "2")
    again = common.record("x", {"v": 4})
    assert (first.name, second.name, third.name, again.name) == (
        "x.json",
        "x_2.json",
        "x_2.json",
        "x.json",
    )
    assert [json.loads((results / n).read_text())["v"] for n in ("x.json", "x_2.json")] == [4, 3]


def test_the_commit_is_dirty_only_for_changes_outside_the_results(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert not common.git_commit(tmp_path).endswith("(dirty)")
    (tmp_path / "bench" / "results" / "new.json").write_text("{}")
    assert not common.git_commit(tmp_path).endswith("(dirty)")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert common.git_commit(tmp_path).endswith(" (dirty)")
