"""The `epcluster` command line."""

import argparse
import json
import sys

import torch


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        llm = LLM(args.model)
        if args.json:
            out = llm.generate(args.prompt, params)[0]
            print(
                json.dumps(
                    {
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        "prompt_tokens": out.num_prompt_tokens,
                        "completion_tokens": out.num_completion_tokens,
                    }
                )
            )
            return 0
        for delta in llm.stream(args.prompt, params):
            print(delta.text, end="", flush=True)
        print()
    except ValueError as e:
        print(f"epcluster: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epcluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation in-process")
    gen.add_argument("--model", default="tiny", help="preset (tiny, small) or checkpoint directory")
    gen.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
