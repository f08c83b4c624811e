"""The `epcluster` command line.

epcluster serve [--config FILE] [--model M] [--prefill-ranks N] [--decode-ranks N] ...
epcluster stop [--address HOST:PORT|auto] [--cluster-name NAME | --config FILE]
epcluster generate --prompt TEXT [--target HOST:PORT | --model M] [sampling flags] [--json]
epcluster status --target HOST:PORT [--expert-load PNG]
epcluster rebalance --target HOST:PORT [--pool prefill|decode] [--save FILE]
epcluster plan --model M --gpu G --workload W [--slo-ttft S --slo-tpot S] [--json]
"""

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine import SamplingParams
    from engine.messages import RebalanceStatus
    from router.auth import ClientSecurity


def _sampling(args: argparse.Namespace) -> "SamplingParams":
    from engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def _print_result(
    args: argparse.Namespace,
    text: str,
    token_ids: list[int],
    finish: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> None:
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": token_ids,
                    "finish_reason": finish,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                }
            )
        )


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    if args.target:
        return _generate_remote(args, params)
    from engine import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(args.model)
    if args.json:
        out = llm.generate(args.prompt, params)[0]
        _print_result(
            args,
            out.text,
            out.token_ids,
            out.finish_reason,
            out.num_prompt_tokens,
            out.num_completion_tokens,
        )
        return 0
    for delta in llm.stream(args.prompt, params):
        print(delta.text, end="", flush=True)
    print()
    return 0


def _generate_remote(args: argparse.Namespace, params: "SamplingParams") -> int:
    from router.api.convert import output_from_proto
    from router.client import InferenceClient

    client = InferenceClient(args.target, security=client_security(args))
    try:
        text, ids, last = "", [], None
        for response in client.generate(args.prompt, params, timeout=args.timeout):
            last = output_from_proto(response)
            text += last.text
            ids += last.token_ids
            if not args.json:
                print(last.text, end="", flush=True)
        if args.json and last is not None:
            _print_result(
                args,
                text,
                ids,
                last.finish_reason,
                last.num_prompt_tokens,
                last.num_completion_tokens,
            )
        elif not args.json:
            print()
    finally:
        client.close()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from router.client import InferenceClient

    client = InferenceClient(args.target, security=client_security(args))
    try:
        status = client.cluster_status()
        info = client.model_info()
        print(
            f"model {info.model} ({info.model_type}), health {client.health()}, "
            f"in flight {status.num_in_flight}, queued {status.num_queued}"
        )
        for pool in status.pools:
            for r in pool.ranks:
                print(
                    f"  {pool.name:7} rank {r.rank}: {'ready' if r.ready else 'NOT READY'}, "
                    f"running {r.num_running}, waiting {r.num_waiting}, KV {r.kv_used_blocks}/"
                    f"{r.kv_total_blocks} blocks ({100 * r.kv_usage:.0f}%), "
                    f"{len(next(iter(r.expert_ids.values()), []))} expert slots"
                )
                if r.spec_draft_tokens:
                    print(
                        f"  {pool.name:7} rank {r.rank}: speculative decoding accepted "
                        f"{r.spec_accepted_tokens}/{r.spec_draft_tokens} drafts "
                        f"({100 * r.spec_acceptance_rate:.0f}%), "
                        f"{r.spec_tokens_per_verify:.2f} tokens per verify step"
                    )
            lead = pool.ranks[0].rebalance if pool.ranks else None
            if lead is not None:
                print(f"  {pool.name:7} experts: {describe_rebalance(lead)}")
        if args.expert_load:
            from cluster.plots import draw_expert_load

            pools = client.expert_load()
            for pool in pools:
                for layer, per_rank in sorted(pool.rank_tokens().items()):
                    total = sum(per_rank) or 1
                    shares = " ".join(f"{n / total:.2f}" for n in per_rank)
                    print(f"  {pool.pool:7} layer {layer}: tokens per rank {shares} of {total}")
            print(f"expert load heatmap: {draw_expert_load(pools, args.expert_load)}")
    finally:
        client.close()
    return 0


def describe_rebalance(r: "RebalanceStatus") -> str:
    if not r.number:
        return "no rebalance yet"
    return (
        f"rebalance {r.number} {r.outcome}{' (moving)' if r.moving else ''}: balancedness "
        f"{r.balancedness_before:.3f} -> {r.balancedness_after:.3f} (mean / max rank load), "
        f"{r.slots_moved} slots in {r.layers_moved} layers moved in {r.duration_s:.2f} s, "
        f"longest pause {1000 * r.longest_pause_s:.1f} ms"
    )


def cmd_rebalance(args: argparse.Namespace) -> int:
    from router.client import InferenceClient

    with InferenceClient(
        args.target, timeout=args.timeout, security=client_security(args)
    ) as client:
        for pool, status in client.rebalance(args.pool):
            print(f"{pool}: {describe_rebalance(status)}")
        if args.save:
            placements = {
                p.pool: {
                    "layers": sorted(p.layers),
                    "num_ranks": p.num_ranks,
                    "num_experts": p.num_experts,
                    "phy2log": [p.layers[layer][1] for layer in sorted(p.layers)],
                }
                for p in client.expert_load()
            }
            Path(args.save).write_text(json.dumps(placements, indent=1) + "\n")
            print(f"placements saved to {args.save} (start with it: placement_file in a pool)")
    return 0


# `epcluster serve` flag -> the config field it sets, by its dotted path
SERVE_FLAGS = {
    "model": "model",
    "prefill_ranks": "prefill.num_ranks",
    "decode_ranks": "decode.num_ranks",
    "host": "ports.host",
    "port": "ports.port",
    "address": "ray.ray_address",
    "cluster_name": "ray.cluster_name",
    "kv_cache_bytes": "engine.kv_cache_bytes",
    "block_size": "engine.block_size",
    "drain_timeout": "drain_timeout_s",
    "http_port": "ports.http_port",
    "metrics_port": "ports.metrics_port",
    "rank_metrics_port": "ports.rank_metrics_port",
    "auth_token_file": "security.auth_token_file",
    "tls_cert_file": "security.tls_cert_file",
    "tls_key_file": "security.tls_key_file",
    "tls_client_ca_file": "security.tls_client_ca_file",
    "admin_token_file": "security.admin_token_file",
}


def serve_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The config fields the `serve` flags set (None: a flag not given, the file's value stays)."""
    out: dict[str, object] = {path: getattr(args, flag) for flag, path in SERVE_FLAGS.items()}
    if args.kv_transport is not None:
        out["routing.kv_p2p"] = args.kv_transport == "p2p"
    out["security.allow_insecure_bind"] = args.allow_insecure_bind or None
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster.config import ClusterConfig

    config = ClusterConfig.load(args.config, serve_overrides(args))
    if config.ray.ray_address is None:
        # A local Ray stays on loopback; Ray reads this when it is first imported.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from cluster.launcher import Cluster

    print(
        f"epcluster: starting {config.model}: prefill {config.prefill.num_ranks} ranks, "
        f"decode {config.decode.num_ranks} ranks, Ray "
        f"{config.ray.ray_address or 'local'}",
        flush=True,
    )
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    cluster = Cluster(config).start()
    # NOTE: again: ray.init installs its own SIGTERM handler (it aborts the process), which
    # would end the streams in flight instead of draining them.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if stop.is_set():  # a signal during start-up: stop without serving
        cluster.shutdown(drain_s=0)
        return 0
    try:
        print(
            f"epcluster: ready on {cluster.address} (gRPC epcluster.v1.Inference; "
            f"try: epcluster generate --target {cluster.address} --prompt 'A class')"
            + (
                f"; OpenAI HTTP on http://{cluster.http_address}/v1" if cluster.http_address else ""
            ),
            flush=True,
        )
        stop.wait()
        cluster.server.drain()
        print(
            f"epcluster: draining (up to {config.drain_timeout_s:.0f} s): new requests are "
            "refused, streams in flight finish",
            flush=True,
        )
    finally:
        cluster.shutdown()
    print("epcluster: stopped", flush=True)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """Remove a cluster's pools from a Ray cluster for good: the rank actors, the placement
    groups and the record a new router would attach through (cluster/registry.py)."""
    from cluster.config import ClusterConfig

    config = ClusterConfig.load(args.config, {"ray.cluster_name": args.cluster_name})
    import ray

    from cluster import registry

    ray.init(address=args.address, namespace=registry.NAMESPACE, log_to_driver=False)
    try:
        removed = registry.remove_pools(config.ray.cluster_name)
    finally:
        ray.shutdown()
    if not removed:
        print(f"epcluster: no pools of cluster {config.ray.cluster_name!r} on {args.address}")
        return 1
    print(f"epcluster: removed {', '.join(removed)}", flush=True)
    return 0


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """How to reach a router that requires a token and/or TLS (README "Security")."""
    parser.add_argument("--token-file", help="send the bearer token in this file")
    parser.add_argument("--tls-ca-file", help="PEM CA of the router's certificate: use TLS")
    parser.add_argument("--tls-cert-file", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    parser.add_argument("--tls-server-name", help="check the router's certificate for this name")
    parser.add_argument(
        "--admin-token-file",
        default=os.environ.get("EPCLUSTER_ADMIN_TOKEN_FILE"),
        help="send the admin token in this file instead (admin calls: rebalance); "
        "default $EPCLUSTER_ADMIN_TOKEN_FILE",
    )


def client_security(args: argparse.Namespace) -> "ClientSecurity | None":
    """-> router.auth.ClientSecurity, or None for a plaintext, open router."""
    from router.auth import ClientSecurity

    token_file = args.admin_token_file or args.token_file  # the admin token is a client's too
    if not (token_file or args.tls_ca_file or args.tls_cert_file or args.tls_key_file):
        return None
    if (args.tls_cert_file or args.tls_key_file) and not args.tls_ca_file:
        raise ValueError("--tls-cert-file and --tls-key-file need --tls-ca-file (TLS)")
    return ClientSecurity.from_files(
        token_file, args.tls_ca_file, args.tls_cert_file, args.tls_key_file,
        args.tls_server_name,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epcluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start Ray pools and the gRPC router")
    serve.add_argument("--config", help="YAML file (see deploy/config.example.yaml)")
    serve.add_argument("--model", help="preset (tiny, tiny-random, small) or checkpoint directory")
    serve.add_argument("--prefill-ranks", type=int)
    serve.add_argument("--decode-ranks", type=int)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--address",
        help="join this Ray cluster (auto, or host:port); attach to the pools it runs, if any",
    )
    serve.add_argument("--cluster-name", help="names the pools on Ray (default: default)")
    serve.add_argument("--kv-cache-bytes", type=int, help="KV cache budget per rank")
    serve.add_argument("--block-size", type=int)
    serve.add_argument("--kv-transport", choices=["object_store", "p2p"])
    serve.add_argument(
        "--drain-timeout", type=float, help="seconds in-flight streams get on SIGTERM / Ctrl-C"
    )
    serve.add_argument("--http-port", type=int, help="OpenAI-compatible HTTP (0: any free port)")
    serve.add_argument("--metrics-port", type=int, help="router /metrics and /sd/targets (0: any)")
    serve.add_argument("--rank-metrics-port", type=int, help="first port of the ranks' /metrics")
    serve.add_argument("--auth-token-file", help="require this bearer token (gRPC and HTTP)")
    serve.add_argument("--tls-cert-file", help="PEM server certificate: TLS on gRPC and HTTP")
    serve.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    serve.add_argument(
        "--tls-client-ca-file", help="PEM CA: mutual TLS, clients need a certificate it signed"
    )
    serve.add_argument("--admin-token-file", help="require this token for admin calls")
    serve.add_argument(
        "--allow-insecure-bind",
        action="store_true",
        help="serve a non-loopback --host without a token or mutual TLS",
    )
    serve.set_defaults(func=cmd_serve)

    stop = sub.add_parser("stop", help="remove a cluster's pools from a Ray cluster for good")
    stop.add_argument("--address", default="auto", help="the Ray cluster (auto, or host:port)")
    stop.add_argument("--cluster-name", help="whose pools (default: the config's, or default)")
    stop.add_argument("--config", help="take ray.cluster_name from this YAML file")
    stop.set_defaults(func=cmd_stop)

    gen = sub.add_parser("generate", help="generate a continuation (in-process or via --target)")
    gen.add_argument("--target", help="a running router, HOST:PORT")
    gen.add_argument("--model", default="tiny", help="in-process: preset or checkpoint dir")
    gen.add_argument("--threads", type=int, default=2, help="in-process torch CPU threads")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--timeout", type=float, default=None, help="seconds (a gRPC deadline)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    add_client_flags(gen)
    gen.set_defaults(func=cmd_generate)

    rebalance = sub.add_parser("rebalance", help="re-place the experts of a running cluster now")
    rebalance.add_argument("--target", default="127.0.0.1:50051")
    rebalance.add_argument("--pool", choices=["prefill", "decode"], help="one pool (default both)")
    rebalance.add_argument("--save", metavar="FILE", help="then save the placements (JSON)")
    rebalance.add_argument("--timeout", type=float, default=600.0)
    add_client_flags(rebalance)
    rebalance.set_defaults(func=cmd_rebalance)

    status = sub.add_parser("status", help="pools, ranks and KV usage of a running router")
    status.add_argument("--target", default="127.0.0.1:50051")
    status.add_argument(
        "--expert-load", metavar="PNG", help="also draw each pool's expert load as heatmaps"
    )
    add_client_flags(status)
    status.set_defaults(func=cmd_status)

    from cluster.plan.report import add_plan_parser

    add_plan_parser(sub)  # epcluster plan (cluster/plan/, docs/planning.md)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # bad input or config: say what to fix
        print(f"epcluster: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import grpc

        if isinstance(e, grpc.RpcError):
            print(f"epcluster: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
