"""Workloads: a request rate with prompt / output length distributions and a prefix-hit ratio
(a stats file, JSON), a recorded trace (trace.jsonl), or a built-in name; and seeded samples.

Trace lines: {"arrival_s": 0.12, "prompt_tokens": 900, "output_tokens": 200, "cached_tokens": 0}.
"""

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Request:
    prompt: int
    output: int
    cached: int  # prompt positions that hit the prefix cache (read, not computed)


@dataclass(frozen=True, slots=True)
class Workload:
    """Poisson arrivals at `rate` requests/s over the whole deployment; lengths lognormal with
    the given means and shape `sigma` (0: every request has the mean lengths)."""

    name: str
    rate: float
    prompt_mean: float
    output_mean: float
    prefix_hit: float = 0.0  # fraction of input tokens served from the prefix cache
    sigma: float = 0.0
    trace: tuple[tuple[float, Request], ...] | None = None  # (arrival_s, request), sorted
    source: str = ""

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.prompt_mean < 1 or self.output_mean < 1:
            raise ValueError(f"workload {self.name}: rate > 0, prompt and output means >= 1")
        if not 0 <= self.prefix_hit < 1 or self.sigma < 0:
            raise ValueError(f"workload {self.name}: prefix_hit in [0, 1), sigma >= 0")

    def sample(self, n: int, seed: int = 0) -> list[Request]:
        """`n` requests (a trace is resampled with replacement), the same for the same seed."""
        rng = random.Random(seed)
        if self.trace:
            return [rng.choice(self.trace)[1] for _ in range(n)]
        out = []
        for _ in range(n):
            prompt = self._draw(rng, self.prompt_mean)
            out.append(Request(prompt, self._draw(rng, self.output_mean), 0))
        # the hit ratio is a share of tokens: every prompt reuses that share of its positions
        return [Request(r.prompt, r.output, int(r.prompt * self.prefix_hit)) for r in out]

    def _draw(self, rng: random.Random, mean: float) -> int:
        if self.sigma == 0:
            return max(1, round(mean))
        mu = math.log(mean) - self.sigma**2 / 2  # lognormal with this mean
        return max(1, round(rng.lognormvariate(mu, self.sigma)))

    def scaled(self, rate: float) -> "Workload":
        return Workload(
            self.name, rate, self.prompt_mean, self.output_mean, self.prefix_hit, self.sigma,
            self.trace, self.source,
        )  # fmt: skip


# DeepSeek's published day (Inference System Overview, Mar 2025): 608B input tokens (56.3% cache
# hits), 168B output tokens in 24 h, mean KV length per output token 4,989. Then output/input =
# 168/608, and prompt + output / 2 = 4,989 gives prompt 4,390, output 1,213 tokens per request,
# and 608e9 / 4,390 / 86,400 = 1,603 requests/s. Lengths: lognormal, sigma 1 (assumption).
BUILTIN: dict[str, Workload] = {
    "deepseek-v3-day": Workload(
        "deepseek-v3-day", 1603.0, 4390, 1213, 0.563, 1.0,
        source="DeepSeek's published daily totals (608B in, 168B out, 56.3% hits, KV 4,989)",
    ),
    "chat-small": Workload(
        "chat-small", 2.0, 128, 128, 0.0, 0.5, source="local benchmark shape (bench/goodput.py)"
    ),
}  # fmt: skip


def load_workload(spec: str) -> Workload:
    """A built-in name, a stats file (JSON with rate, prompt_mean, output_mean, prefix_hit,
    sigma) or a trace (*.jsonl)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"workload {spec!r}: not one of {sorted(BUILTIN)} and no such file")
    if path.suffix == ".jsonl":
        return _trace(path)
    raw = json.loads(path.read_text())
    known = {"rate", "prompt_mean", "output_mean", "prefix_hit", "sigma"}
    if unknown := set(raw) - known:
        raise ValueError(f"workload {spec}: unknown fields {sorted(unknown)} (known {known})")
    return Workload(path.stem, source=str(path), **raw)


def _trace(path: Path) -> Workload:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        try:
            req = Request(
                int(d["prompt_tokens"]), int(d["output_tokens"]), int(d.get("cached_tokens", 0))
            )
            rows.append((float(d["arrival_s"]), req))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}:{n}: {e}") from e
    if len(rows) < 2:
        raise ValueError(f"{path}: a trace needs at least 2 requests")
    rows.sort(key=lambda r: r[0])
    span = rows[-1][0] - rows[0][0] or 1.0
    prompts = sum(r.prompt for _, r in rows)
    return Workload(
        path.stem,
        (len(rows) - 1) / span,
        prompts / len(rows),
        sum(r.output for _, r in rows) / len(rows),
        min(sum(r.cached for _, r in rows) / prompts, 0.999),
        trace=tuple(rows),
        source=str(path),
    )
