"""The `epcluster` command line.

epcluster serve [--config FILE] [--model M] [--prefill-ranks N] [--decode-ranks N] ...
epcluster stop [--address HOST:PORT|auto] [--cluster-name NAME | --config FILE]
epcluster generate --prompt TEXT [--target HOST:PORT | --model M] [sampling flags] [--json]
epcluster status --target HOST:PORT [--expert-load PNG]
epcluster rebalance --target HOST:PORT [--pool prefill|decode] [--save FILE]
epcluster plan --model M --gpu G --workload W [--slo-ttft S --slo-tpot S] [--json]
"""

import argparse
import logging
import os
import signal
import sys
import threading

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

    from cluster.cli_client import add_client_parsers

    add_client_parsers(sub)  # generate, rebalance, status
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
