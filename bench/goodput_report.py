"""bench/goodput.py's reading and reporting: per-load figures from guidellm's report or from
bench/openloop.py's records, the measured-beside-planned table (markdown) and the plot."""

import json
import statistics
from pathlib import Path

from bench.common import RESULTS


def summarise(report: dict, slo_ttft: float, slo_tpot: float) -> dict:
    """Percentiles, throughput and goodput of one guidellm benchmark (its per-request records).
    TPOT is the inter-token latency (the first token excluded), as the plan defines it."""
    bench = report["benchmarks"][0]
    done = bench["requests"]["successful"]
    failed = len(bench["requests"]["errored"]) + len(bench["requests"]["incomplete"])
    seconds = bench["duration"]
    ttft = [r["time_to_first_token_ms"] / 1000 for r in done]
    tpot = [(r["inter_token_latency_ms"] or 0.0) / 1000 for r in done]
    e2e = [r["request_latency"] for r in done]
    good = sum(1 for a, b in zip(ttft, tpot) if a <= slo_ttft and b <= slo_tpot)

    def pct(xs: list[float], q: int) -> float | None:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else None

    return {
        "requests": len(done),
        "failed": failed,
        "duration_s": seconds,
        "throughput_rps": len(done) / seconds,
        "input_tokens_per_s": sum(r["prompt_tokens"] for r in done) / seconds,
        "output_tokens_per_s": sum(r["output_tokens"] for r in done) / seconds,
        "goodput_rps": good / seconds,
        **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_s": pct(tpot, q) for q in (50, 90, 99)},
        **{f"e2e_p{q}_s": pct(e2e, q) for q in (50, 90, 99)},
    }


def summarise_records(records: list, slo_ttft: float, slo_tpot: float) -> dict:
    """The same figures from bench/openloop.py's records, plus the rate delivered: requests over
    the span of their sends (the n - 1 gaps of n sends), and how late the sends were."""
    done = [r for r in records if r.error is None and r.first_s is not None]
    if not done:
        raise RuntimeError(f"no request completed; the first error: {records[0].error}")
    sent = sorted(r.sent_s for r in records)
    seconds = max(r.last_s for r in done) - sent[0]
    ttft = [r.first_s - r.sent_s for r in done]
    tpot = [(r.last_s - r.first_s) / max(r.output_tokens - 1, 1) for r in done]
    e2e = [r.last_s - r.sent_s for r in done]
    good = sum(1 for a, b in zip(ttft, tpot) if a <= slo_ttft and b <= slo_tpot)
    late = sorted(r.sent_s - r.scheduled_s for r in records)

    def pct(xs: list[float], q: int) -> float | None:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else None

    return {
        "requests": len(done),
        "failed": len(records) - len(done),
        "delivered_rps": (len(sent) - 1) / (sent[-1] - sent[0]),
        "send_delay_p99_s": pct(late, 99),
        "duration_s": seconds,
        "throughput_rps": len(done) / seconds,
        "input_tokens_per_s": sum(r.prompt_tokens for r in done) / seconds,
        "output_tokens_per_s": sum(r.output_tokens for r in done) / seconds,
        "goodput_rps": good / seconds,
        **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_s": pct(tpot, q) for q in (50, 90, 99)},
        **{f"e2e_p{q}_s": pct(e2e, q) for q in (50, 90, 99)},
    }


def plot(rows: list[dict], mode: str, path: Path) -> None:
    """Throughput and goodput, and TTFT / TPOT medians (measured; the plan's dashed), by load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [r["load"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(loads, [r["throughput_rps"] for r in rows], "o-", label="throughput")
    a.plot(loads, [r["goodput_rps"] for r in rows], "s-", label="goodput")
    b.plot(loads, [r["ttft_p50_s"] for r in rows], "o-", label="TTFT p50")
    b.plot(loads, [r["tpot_p50_s"] for r in rows], "s-", label="TPOT p50")
    if all("plan" in r for r in rows):
        a.plot(loads, [r["plan"]["goodput_rps"] for r in rows], "s--", label="goodput (plan)")
        b.plot(loads, [r["plan"]["ttft_s"] for r in rows], "o--", label="TTFT p50 (plan)")
        b.plot(loads, [r["plan"]["tpot_s"] for r in rows], "s--", label="TPOT p50 (plan)")
    xlabel = "offered requests/s" if mode == "open" else "concurrent streams"
    a.set(xlabel=xlabel, ylabel="requests/s")
    b.set(xlabel=xlabel, ylabel="seconds", yscale="log")
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(path)


COMPARED = (  # (label, measured key, plan key, format)
    ("throughput req/s", "throughput_rps", "throughput_rps", "{:.3f}"),
    ("TTFT p50 s", "ttft_p50_s", "ttft_s", "{:.3f}"),
    ("TPOT p50 ms", "tpot_p50_s", "tpot_s", "{:.1f}"),
)


def table_md(result: dict) -> str:
    """The measurement beside the plan's prediction per load, with the relative error
    (plan / measured - 1), as markdown; a cell is within 20% or not."""
    head = "| offered req/s | delivered req/s |" + "".join(
        f" {label} measured | plan | error |" for label, *_ in COMPARED
    )
    lines = [head, "|" + "---:|" * (2 + 3 * len(COMPARED))]
    for row in result["loads"]:
        plan = row.get("plan", {})
        cells = [f"{row['load']:.3f}", f"{row.get('delivered_rps', float('nan')):.3f}"]
        for label, m_key, p_key, fmt in COMPARED:
            scale = 1e3 if "ms" in label else 1.0
            m, p = row[m_key], plan.get(p_key)
            err = "" if p is None else f"{p / m - 1:+.0%}" + ("" if abs(p / m - 1) <= 0.2 else " ✗")
            pred = "" if p is None else fmt.format(p * scale)
            cells += [fmt.format(m * scale), pred, err]
        lines.append("| " + " | ".join(cells) + " |")
    measured = result.get("measured", {}).get("command")
    how = f"measured: `{measured}`\n\nplanned: " if measured else ""
    return "\n".join(lines) + f"\n\n{how}`{result['command']}`\n"


def write_md(name: str, path: Path) -> None:
    (RESULTS / f"{name}.md").write_text(f"# {name}\n\n" + table_md(json.loads(path.read_text())))
