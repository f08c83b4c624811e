"""The engine against transformers' batched generate on the same requests, in one invocation.

    .venv/bin/python -m bench.engine_vs_hf [--model small] [--num-requests 64]

Workload: seeded prompt lengths 16-512 and output lengths 16-256, EOS ignored, greedy. The engine
gets all requests at once (continuous batching). transformers gets them in batches of --hf-batch,
left-padded; a batch runs until its longest request is done, which is how batched generate works.
Both count only the requested output tokens.
"""

import argparse
import time

import torch

from bench.common import record, run_engine, workload
from moe import ModelConfig, resolve_model_path


def run_hf(path: str, requests, batch: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    elapsed = 0.0
    # Batches of similar prompt length waste less padding: sort by prompt length (favours HF).
    order = sorted(range(len(requests)), key=lambda i: len(requests[i][0]))
    for b in range(0, len(order), batch):
        chunk = [requests[i] for i in order[b : b + batch]]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(n for _, n in chunk)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        elapsed += time.perf_counter() - start
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="small")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path(args.model))
    vocab = ModelConfig.from_file(path).vocab_size
    requests = workload(args.num_requests, (16, 512), (16, 256), vocab, args.seed)
    out_tokens = sum(n for _, n in requests)
    engine_s = run_engine(path, requests, kv_cache_bytes=int(args.kv_cache_gb * 2**30))
    print(f"engine: {out_tokens} tokens in {engine_s:.1f} s = {out_tokens / engine_s:.1f} tok/s")
    hf_s = run_hf(path, requests, args.hf_batch)
    print(f"transformers: {out_tokens} tokens in {hf_s:.1f} s = {out_tokens / hf_s:.1f} tok/s")
    ratio = hf_s / engine_s
    print(f"engine / transformers throughput: {ratio:.2f}x")
    print(
        record(
            "engine_vs_hf",
            {
                "model": args.model,
                "requests": args.num_requests,
                "output_tokens": out_tokens,
                "prompt_tokens": sum(len(p) for p, _ in requests),
                "engine_s": round(engine_s, 2),
                "engine_tok_s": round(out_tokens / engine_s, 1),
                "hf_s": round(hf_s, 2),
                "hf_tok_s": round(out_tokens / hf_s, 1),
                "hf_batch": args.hf_batch,
                "ratio": round(ratio, 2),
            },
        )
    )


if __name__ == "__main__":
    main()
