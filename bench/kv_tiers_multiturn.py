"""The tiered KV cache on a multi-turn workload, through a real local cluster (issue 28).

Conversations of 4-8 turns share a system prompt; each turn's prompt is the previous turn's
prompt, its answer and a new user message. More conversations run than the prefill ranks' paged
caches hold (a small kv_cache_bytes), turn by turn over all of them, so a conversation's prefix
is evicted from the paged cache before its next turn. The same seeded workload runs on four
clusters (gRPC, 2 prefill + 2 decode ranks by default): tiers off, host tier only, host + disk,
and host + disk again after a restart of the cluster (a new cluster, the same disk directory,
which the previous one's orderly stop flushed). Per configuration: the input-token hit rate
(cached tokens / prompt tokens, from the usage), the hit tokens per tier (paged = cached minus
the tiers'; host and disk from the prefill ranks' epcluster_kv_tier_hits_total), TTFT p50/p90
and the total time; and whether every answer equals the tiers-off run's (greedy: it must).

    .venv/bin/python -m bench.kv_tiers_multiturn --plot
"""

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.common import RESULTS, record
from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from engine import SamplingParams
from moe.config import ModelConfig
from moe.presets import ensure_preset
from router.client import InferenceClient

CONFIGS = ("off", "host", "host+disk", "host+disk restarted")


def conversations(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Per conversation, its user messages (token ids); the system prompt is [0] of each."""
    gen = torch.Generator().manual_seed(args.seed)

    def draw(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=gen).tolist()

    system = draw(args.system_tokens)
    convs = []
    for _ in range(args.conversations):
        turns = int(torch.randint(args.min_turns, args.max_turns + 1, (1,), generator=gen))
        lo, hi = args.user_tokens
        convs.append(
            [system]
            + [draw(int(torch.randint(lo, hi + 1, (1,), generator=gen))) for _ in range(turns)]
        )
    return convs


def tier_hits(client: InferenceClient) -> dict[str, float]:
    """epcluster_kv_tier_hits_total (blocks) of the prefill ranks, by tier."""
    hits = {"host": 0.0, "disk": 0.0}
    for pool in client.cluster_status().pools:
        if pool.name != "prefill":
            continue
        for rank in pool.ranks:
            with urllib.request.urlopen(f"http://{rank.metrics_endpoint}/metrics", timeout=30) as r:
                page = r.read().decode()
            for family in text_string_to_metric_families(page):
                for s in family.samples:
                    if s.name == "epcluster_kv_tier_hits_total":
                        hits[s.labels["tier"]] = hits.get(s.labels["tier"], 0.0) + s.value
    return hits


def run_workload(
    client: InferenceClient, convs: list[list[list[int]]], args: argparse.Namespace
) -> tuple[list[dict], dict[tuple[int, int], list[int]], float]:
    """Every conversation turn by turn, args.concurrency conversations at a time (conversation
    i on worker i % concurrency, which takes its conversations round robin); -> per request
    (prompt, cached tokens, TTFT), the answers by (conversation, turn), the seconds it took."""
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    rows: list[dict] = []
    answers: dict[tuple[int, int], list[int]] = {}
    lock = threading.Lock()

    def worker(mine: list[int]) -> None:
        prompts = {c: list(convs[c][0]) for c in mine}
        for turn in range(1, args.max_turns + 1):
            for c in mine:
                if turn >= len(convs[c]):
                    continue
                prompts[c] += convs[c][turn]
                start = time.perf_counter()
                ttft, ids, usage = None, [], None
                for message in client.generate(prompts[c], params, timeout=300):
                    if ttft is None and message.token_ids:
                        ttft = time.perf_counter() - start
                    ids += list(message.token_ids)
                    if message.HasField("usage"):
                        usage = message.usage
                with lock:
                    answers[c, turn] = ids
                    rows.append(
                        {
                            "prompt": usage.prompt_tokens,
                            "cached": usage.cached_tokens,
                            "ttft_s": ttft,
                        }
                    )
                prompts[c] += ids

    started = time.perf_counter()
    threads = [
        threading.Thread(target=worker, args=(list(range(w, len(convs), args.concurrency)),))
        for w in range(args.concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, answers, time.perf_counter() - started


def cluster_config(args: argparse.Namespace, tiers: dict | None) -> ClusterConfig:
    engine: dict = {"kv_cache_bytes": args.paged_blocks * args.block_bytes}
    if tiers is not None:
        engine["kv_tiers"] = tiers
    return ClusterConfig.load(
        None,
        {
            "ports.port": 0,
            "ports.http_port": None,
            "ports.metrics_port": None,
            "ports.rank_metrics_port": 0,
            "model": args.model,
            "prefill.num_ranks": args.prefill_ranks,
            "decode.num_ranks": args.decode_ranks,
            "prefill.engine": engine,
        },
    )


def summarise(rows: list[dict], hits: dict[str, float], seconds: float, bs: int) -> dict:
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    ttft = [r["ttft_s"] for r in rows]
    q = statistics.quantiles(ttft, n=10, method="inclusive")
    host, disk = int(hits.get("host", 0)) * bs, int(hits.get("disk", 0)) * bs
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4),
        "hit_tokens": {"paged": cached - host - disk, "host": host, "disk": disk},
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p90_s": round(q[8], 4),
        "total_s": round(seconds, 2),
    }


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    bottom = [0.0] * len(names)
    for tier in ("paged", "host", "disk"):
        share = [results[n]["hit_tokens"][tier] / results[n]["prompt_tokens"] for n in names]
        a.bar(names, share, bottom=bottom, label=tier)
        bottom = [x + y for x, y in zip(bottom, share)]
    a.set(ylabel="input tokens served from cache", ylim=(0, 1))
    a.legend()
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [results[n]["ttft_p50_s"] for n in names], 0.4, label="p50")
    b.bar([i + 0.2 for i in x], [results[n]["ttft_p90_s"] for n in names], 0.4, label="p90")
    b.set(xticks=list(x), xticklabels=names, ylabel="TTFT (s)")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prefill-ranks", type=int, default=2)
    parser.add_argument("--decode-ranks", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--min-turns", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=128)
    parser.add_argument("--user-tokens", type=int, nargs=2, default=[32, 80])
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations at a time")
    parser.add_argument("--paged-blocks", type=int, default=80, help="per prefill rank")
    parser.add_argument("--host-blocks", type=int, default=192, help="per prefill rank")
    parser.add_argument("--disk-blocks", type=int, default=4096, help="the shared directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--name", default="kv_tiers_multiturn")
    parser.add_argument("--plot", action="store_true", help=f"also {RESULTS}/<name>.png")
    args = parser.parse_args()
    mc = ModelConfig.from_file(ensure_preset(args.model))
    engine = ClusterConfig.load(None, {"model": args.model}).engine_config("prefill")
    bs, itemsize = engine.block_size, engine.torch_dtype.itemsize
    args.block_bytes = mc.num_hidden_layers * bs * mc.kv_cache_width * itemsize
    convs = conversations(args, mc.vocab_size)
    host = {"host_bytes": args.host_blocks * args.block_bytes}
    results: dict[str, dict] = {}
    reference: dict | None = None
    with tempfile.TemporaryDirectory(prefix="kv_tiers_bench_") as disk_dir:
        disk = {**host, "disk_path": disk_dir, "disk_bytes": args.disk_blocks * args.block_bytes}
        tiers = {"off": None, "host": host, "host+disk": disk, "host+disk restarted": disk}
        for name in args.configs.split(","):
            cluster = Cluster(cluster_config(args, tiers[name])).start()
            try:
                with InferenceClient(cluster.address, timeout=300) as client:
                    rows, answers, seconds = run_workload(client, convs, args)
                    hits = tier_hits(client)
            finally:
                cluster.shutdown(remove_pools=True)  # an orderly stop: the tiers flush
            results[name] = summarise(rows, hits, seconds, bs)
            reference = answers if reference is None else reference
            results[name]["same_answers_as_first"] = answers == reference
            print(name, json.dumps(results[name]), flush=True)
    workload = {
        k: getattr(args, k)
        for k in ("model", "prefill_ranks", "decode_ranks", "conversations", "min_turns")
        + ("max_turns", "system_tokens", "user_tokens", "answer_tokens", "concurrency")
        + ("paged_blocks", "host_blocks", "disk_blocks", "seed", "block_bytes")
    }
    path = record(args.name, {"workload": workload, "block_size": bs, "results": results})
    path.with_suffix(".md").write_text(markdown(results, path))
    if args.plot:
        plot(results, RESULTS / f"{args.name}.png")
    print(f"recorded {path}")


def markdown(results: dict[str, dict], path: Path) -> str:
    """The table of the result file at path, with its command, commit, date, load and note."""
    recorded = json.loads(path.read_text())
    workload = ", ".join(f"{k} {v}" for k, v in recorded["workload"].items())
    lines = [
        f"# {path.stem}: the tiered KV cache on a multi-turn workload",
        "",
        f"`{recorded['command']}` at {recorded['date']}, commit {recorded['commit']}, "
        f"{recorded['cpu']} ({recorded['cores']} cores), load average "
        f"{recorded['load_average']}. Note: {recorded.get('note', 'none')}.",
        "",
        f"Workload: {workload}. Hit tokens by tier: paged = cached - host - disk.",
        "",
        "| config | hit rate | paged / host / disk hit tokens | TTFT p50 (s) | TTFT p90 (s) "
        "| total (s) | same answers |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        t = r["hit_tokens"]
        lines.append(
            f"| {name} | {r['hit_rate']:.1%} | {t['paged']} / {t['host']} / {t['disk']} "
            f"| {r['ttft_p50_s']} | {r['ttft_p90_s']} | {r['total_s']} "
            f"| {r['same_answers_as_first']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
