"""An open-loop load of seeded Poisson arrivals over the OpenAI HTTP API (/v1/completions,
streamed), for bench/goodput.py where guidellm cannot hold the offered rate on this machine.

Arrival times are drawn before the run (exponential gaps, `random.Random(seed)`), and each
request is sent at its time whatever the others are doing (open loop: one asyncio task per
request, no concurrency cap). Prompts are token ids: a prefix shared by every prompt, then a
unique part, both seeded; outputs are exactly `output_tokens` long (ignore_eos). Per request it
records when it was sent, when its first and last tokens came, and how many came, so the
report gives the rate that was delivered (not only the one offered) and how late sends were.
"""

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the load extra's client; the arrivals and records import without it
    import httpx


@dataclass(frozen=True, slots=True)
class OpenLoop:
    target: str  # http://host:port
    model: str
    rate: float  # requests/s offered
    requests: int
    prompt_tokens: int  # unique part of each prompt
    prefix_tokens: int  # shared by every prompt
    output_tokens: int
    vocab: int
    seed: int = 0
    # the i-th load of a series: the same arrivals and shared prefix, unique parts of its own (a
    # prompt an earlier load sent would hit the prefix cache: its TTFT would be a cached one)
    level: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.requests < 1 or self.output_tokens < 2:
            raise ValueError("rate > 0, requests >= 1 and output_tokens >= 2")


@dataclass(frozen=True, slots=True)
class Record:
    scheduled_s: float  # the arrival the schedule asked for, from the run's start
    sent_s: float
    first_s: float | None  # first token
    last_s: float | None
    output_tokens: int
    prompt_tokens: int
    error: str | None


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n Poisson arrival times (s from the start): the first at 0, then exponential gaps."""
    rng = random.Random(seed)
    t, out = 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def prompts(cfg: OpenLoop) -> list[list[int]]:
    """Token-id prompts: one shared prefix (the seed's), then a unique part each (the seed's
    and the level's; ids >= 2: 0 and 1 are BOS and EOS of the presets)."""
    rng = random.Random(cfg.seed + 1)
    prefix = [rng.randrange(2, cfg.vocab) for _ in range(cfg.prefix_tokens)]
    if cfg.level:
        rng = random.Random(f"{cfg.seed}/{cfg.level}")
    return [
        prefix + [rng.randrange(2, cfg.vocab) for _ in range(cfg.prompt_tokens)]
        for _ in range(cfg.requests)
    ]


async def _one(
    client: "httpx.AsyncClient", cfg: OpenLoop, prompt: list[int], at: float, start: float
) -> Record:
    import httpx

    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": cfg.output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = last = None
    tokens, error = 0, None
    try:
        async with client.stream("POST", f"{cfg.target}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                        now = time.perf_counter()
                        first = now if first is None else first
                        last = now
    except httpx.HTTPError as e:
        error = repr(e)
    first_s = None if first is None else first - start
    last_s = None if last is None else last - start
    return Record(at, sent - start, first_s, last_s, tokens, len(prompt), error)


async def run(cfg: OpenLoop) -> list[Record]:
    """Send every request at its arrival time; -> one Record per request, in arrival order."""
    import httpx  # `pip install -e '.[load]'` (the tests read only the arrivals and records)

    times, texts = arrivals(cfg.requests, cfg.rate, cfg.seed), prompts(cfg)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter() + 0.5  # tasks created before the first arrival
        tasks = [_one(client, cfg, p, t, start) for p, t in zip(texts, times)]
        return list(await asyncio.gather(*tasks))
