"""The `epcluster` commands that talk to a running router (or run the engine in-process):
generate, status, rebalance, and the flags that reach a router behind a token or TLS."""

import argparse
import json
import os
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


def add_client_parsers(sub: "argparse._SubParsersAction") -> None:
    """generate, rebalance and status under `epcluster`."""
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
