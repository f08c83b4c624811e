"""Shared pieces of the router tests: a real LLMEngine on the tiny-random preset behind
LocalBackend, the in-process LLM as the oracle, and a way to look at the engine safely from a
test."""

import asyncio
import collections
import time

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine
from router.backends.local import LocalBackend

KV_CACHE_BYTES = 8 << 20  # a few thousand 4-token blocks: small, and usage visibly moves
FUZZ_CASES: dict[str, collections.Counter] = {}  # fuzz test -> outcome -> cases run


def record_fuzz_cases(test: str, counts: collections.Counter) -> None:
    """Keep a fuzz test's case counts for the terminal summary (CI's log shows them)."""
    FUZZ_CASES.setdefault(test, collections.Counter()).update(counts)


def pytest_terminal_summary(terminalreporter) -> None:
    """A "fuzz cases" section: each fuzz test's number of cases and their outcomes."""
    if not FUZZ_CASES:
        return
    terminalreporter.section("fuzz cases")
    for test, counts in FUZZ_CASES.items():
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        terminalreporter.write_line(f"{test}: {sum(counts.values())} cases ({outcomes})")


def make_engine(**options: object) -> LLMEngine:
    torch.set_num_threads(1)
    options.setdefault("kv_cache_bytes", KV_CACHE_BYTES)
    return LLMEngine(EngineConfig(model="tiny-random", block_size=4, **options))


def on_engine(backend: LocalBackend, fn):
    """fn(engine) run on the backend's engine thread, from sync test code."""
    return asyncio.run(backend.call(fn))


def engine_load(engine: LLMEngine) -> tuple[bool, int]:
    return engine.has_unfinished(), engine.block_manager.num_used_blocks


def wait_idle(backend: LocalBackend, timeout: float = 5.0) -> tuple[bool, int]:
    """Wait until the engine has no request and no used KV block; -> the last (unfinished,
    used blocks) seen, (False, 0) when it settled."""
    end = time.monotonic() + timeout
    while True:
        state = on_engine(backend, engine_load)
        if state == (False, 0) or time.monotonic() > end:
            return state
        time.sleep(0.02)


@pytest.fixture(scope="session")
def oracle() -> LLM:
    torch.set_num_threads(1)
    return LLM("tiny-random", block_size=4)


@pytest.fixture(scope="module")
def backend():
    backend = LocalBackend(make_engine())
    yield backend
    backend.close()
    assert backend.error is None


@pytest.fixture(scope="module")
def v1_client(backend):
    """An epcluster.v1 client of a router over the module's backend."""
    from router.client import InferenceClient
    from router.server import serve

    server = serve(backend, port=0)
    assert server.wait_ready(10)
    with InferenceClient(server.address, timeout=30) as client:
        yield client
    server.stop()
