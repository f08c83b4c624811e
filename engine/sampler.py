"""Token sampling: temperature, top-k, top-p, min-p, then a seeded exponential race.

Legend (kernels/__init__.py): B rows (one per request being sampled), V vocabulary.

NOTE: sampling randomness is a pure function of (request seed, token position), never of a
process-wide generator or of the batch: a row draws its noise from a generator seeded with
mix(seed, position) only, so the same request samples the same token on any rank, after a
preemption, or in a batch of any size and make-up. The noise stream depends on the device type
(the CPU and CUDA generators differ), so ranks that must agree must sample on the same kind.
"""

from dataclasses import dataclass

import torch

from engine.messages import TokenLogprobs
from engine.sampling_params import SamplingParams
from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One splitmix64 step: a bijective, well-mixing map of 64-bit ints (Steele et al. 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed for the token at `position` of a request with `seed`, in [0, 2**63).

    Mixing twice keeps nearby (seed, position) pairs from giving correlated streams.
    """
    return splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


@dataclass(slots=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf the logits that top-k, then top-p, then min-p remove (vLLM's order).

    logits: [B, V] float32, already divided by the temperature.
    top_k: [B] int64, <= 0 means off. top_p: [B] float32 in (0, 1]. min_p: [B] float32 in [0, 1].
    Returns a new [B, V] float32 tensor. The top token of every row is always kept.
    """
    assert logits.dim() == 2 and logits.dtype == torch.float32, (logits.shape, logits.dtype)
    n, v = logits.shape
    assert top_k.shape == top_p.shape == min_p.shape == (n,)
    # Everything happens in descending order, where each filter is a prefix of the row.
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(v, device=logits.device)  # [V]

    # Step 1: top-k keeps the first k ranks (of tied logits at the boundary, some may be dropped).
    k = torch.where(top_k > 0, top_k.clamp(max=v), v)  # [B]
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))

    # Step 2: top-p keeps the smallest prefix with cumulative prob >= p: a token stays if the
    # probability mass strictly before it is < p. The first token has mass 0 before it, so it stays.
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]
    # Rounding can push the running sum past 1.0, so p = 1 must skip the filter, not compare.
    # NOTE: rank 0 is kept explicitly: a top_p under 1.4e-45 is 0 in float32, and mass 0 >= 0
    # would drop every token (softmax of all -inf is nan, and argmax then says token 0).
    drop_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (rank[None, :] > 0)
    sorted_logits = sorted_logits.masked_fill(drop_p, float("-inf"))

    # Step 3: min-p drops tokens below min_p * the top prob. The ratio of two kept probs does not
    # change with renormalisation, so compare in log space against the top logit.
    threshold = sorted_logits[:, :1] + torch.log(min_p)[:, None]  # [B, 1]; -inf when min_p == 0
    sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))

    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_race(probs: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """argmax(probs / q) per row, q ~ Exp(1) iid, which samples token i with prob probs[i].

    probs: [B, V] float32. Returns [B] int64.
    """
    q = torch.empty_like(probs)  # [B, V]
    gen = torch.Generator(device=probs.device)
    for i, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        gen.manual_seed(noise_seed(seed, pos))
        q[i].exponential_(generator=gen)
    # An Exp(1) draw of exactly 0 would turn a zero-probability token into 0/0 = nan.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs / q).argmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return [None] * len(params)
    idx = torch.tensor(rows, device=logits.device)
    logprobs = logits[idx].log_softmax(dim=-1)  # [n, V]
    chosen_ids = token_ids[idx]  # [n]
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()  # [n]
    chosen_ids = chosen_ids.tolist()
    max_n = max(params[i].logprobs for i in rows)
    top_vals, top_ids = logprobs.topk(min(max_n, logprobs.shape[1]), dim=-1)  # [n, max_n]
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()

    out: list[TokenLogprobs | None] = [None] * len(params)
    for j, i in enumerate(rows):
        n = params[i].logprobs
        top = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
        out[i] = TokenLogprobs(chosen_ids[j], chosen[j], top)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 -> [B] int64, the lowest index on ties (torch.argmax's rule; the
    compiled kernel on CPU, where torch's reads 32 x 32000 logits at about 2 GB/s)."""
    if use_cpu_kernel(logits) and logits.shape[1] > 0:
        return cpu_kernels().argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> SampleOutput:
    """Pick one token per row.

    logits: [B, V], cast to float32. params, seeds, positions: length B; seeds[i] is the request's
    seed (never None here: the engine draws one for seedless requests), positions[i] the index of
    the sampled token in the request's whole sequence (prompt + output).
    Greedy rows (temperature under MIN_TEMPERATURE) take argmax of the raw logits, lowest index
    on ties.
    Logprobs come from log_softmax of the raw logits, before temperature and filtering.
    Returns SampleOutput with token_ids [B] int64.
    """
    assert logits.dim() == 2, logits.shape
    n = logits.shape[0]
    assert len(params) == len(seeds) == len(positions) == n, (n, len(params), len(seeds))
    logits = logits.float()
    device = logits.device

    token_ids = argmax(logits)  # [B]; right for greedy rows, overwritten for the others
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=device)
        sub = [params[i] for i in rows]
        temperature = torch.tensor([p.temperature for p in sub], device=device)
        top_k = torch.tensor([p.top_k for p in sub], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p for p in sub], device=device)
        min_p = torch.tensor([p.min_p for p in sub], device=device)
        scaled = logits[idx] / temperature[:, None]  # [n, V]
        # With every filter off, filter_logits returns its input unchanged: skip the sort.
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sub):
            scaled = filter_logits(scaled, top_k, top_p, min_p)
        probs = scaled.softmax(dim=-1)  # [n, V]
        sampled = _exponential_race(probs, [seeds[i] for i in rows], [positions[i] for i in rows])
        token_ids[idx] = sampled

    return SampleOutput(token_ids=token_ids, logprobs=_logprobs(logits, token_ids, params))
