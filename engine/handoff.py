"""The decode side of the KV handoff: reservations, and the start of a prefilled request.

A decode rank reserves KV blocks for a prompt before its prefill starts, so the prompt's KV never
arrives to a full cache. When the prefill rank's PrefillResult arrives (the first token and the
prompt's KV), `Reservations.start` imports the KV into the reserved blocks and returns the request,
ready to join the running batch. (The prefill side is LLMEngine.step: a prefill-only request
whose prompt is done leaves the engine as a PrefillResult.)
"""

from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.detokenizer import update_text
from engine.kv_transfer import KVTransferError, import_kv
from engine.messages import GenerateRequest, KVPayload, RequestOutput
from engine.metrics.rank import RankStats
from engine.request import Request
from engine.tokenizer import Tokenizer

RESERVATIONS = "epcluster_kv_reservations_total"


class LeaseLapsed(RuntimeError):
    """A decode rank dropped a router's lease (it renewed nothing for a lease): that router's
    requests there were aborted and its delta stream ends with this error, so the router opens
    a new one and resumes those requests instead of waiting for deltas that never come."""


@dataclass(slots=True)
class Reservation:
    request_id: str
    block_table: list[int]  # blocks for the prompt and its first token
    num_cached_tokens: int  # prompt tokens already in this rank's prefix cache (not imported)
    deadline: float  # time.monotonic() after which an unused reservation is released


class Reservations:
    """The reservation book of one decode rank's engine. Changed on the engine thread only;
    num_blocks, len() and ids() may be read from other threads (a metrics scrape, status)."""

    def __init__(
        self, block_manager: BlockManager, kv_caches: list[torch.Tensor], stats: RankStats
    ) -> None:
        self.block_manager = block_manager
        self.kv_caches = kv_caches
        self.stats = stats
        self._book: dict[str, Reservation] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks held by reservations (KV on its way)."""
        # NOTE: read from the metrics scrape thread while the engine thread inserts: tuple()
        # copies the values in one C call under the GIL, where a generator over the live view
        # would raise "dictionary changed size during iteration".
        return sum(len(r.block_table) for r in tuple(self._book.values()))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._book

    def __len__(self) -> int:
        return len(self._book)

    def ids(self) -> list[str]:
        return sorted(self._book)

    def reserve(self, request_id: str, prompt_token_ids: list[int], deadline: float) -> bool:
        """Hold blocks for the prompt; False (nothing held) when there is no room now."""
        assert request_id not in self._book, request_id
        allocation = self.block_manager.allocate(prompt_token_ids)
        if allocation is None:
            self.stats.inc(RESERVATIONS, 1, "rejected")
            return False
        block_table, num_cached = allocation
        self._book[request_id] = Reservation(request_id, block_table, num_cached, deadline)
        self.stats.inc(RESERVATIONS, 1, "granted")
        return True

    def release(self, request_id: str) -> bool:
        """Give the blocks back; False when the id holds no reservation."""
        held = self._book.pop(request_id, None)
        if held is not None:
            self.block_manager.free(held.block_table)
            self.stats.inc(RESERVATIONS, 1, "released")
        return held is not None

    def renew(self, request_ids: list[str], deadline: float) -> int:
        """Push the deadline of these reservations to `deadline` (a lease the router renews
        while their prefill runs); -> how many are still held."""
        held = [self._book[rid] for rid in request_ids if rid in self._book]
        for r in held:
            r.deadline = max(r.deadline, deadline)
        return len(held)

    def expire(self, now: float) -> list[str]:
        """Release the reservations whose deadline has passed; -> their ids."""
        expired = [rid for rid, r in self._book.items() if r.deadline < now]
        for rid in expired:
            self.block_manager.free(self._book.pop(rid).block_table)
            self.stats.inc(RESERVATIONS, 1, "expired")
        return expired

    def start(
        self,
        request: GenerateRequest,
        first: RequestOutput,
        kv: KVPayload,
        arrival: int,
        tokenizer: Tokenizer,
    ) -> Request:
        """Import the prompt's KV (and a resumed request's earlier output's) into the request's
        reserved blocks -> the request, running, with its first token (already sent to the
        client by the prefill rank). Raises KVTransferError, with the reservation released, if
        the KV does not fit."""
        rid, known = request.request_id, request.known_token_ids
        held = self._book.pop(rid, None)
        if held is None:
            raise KVTransferError(f"request {rid!r} holds no reservation (expired?)")
        self.stats.inc(RESERVATIONS, 1, "started")
        try:
            if kv.num_tokens != len(known):
                raise KVTransferError(
                    f"request {rid!r}: KV for {kv.num_tokens} tokens, the prompt has {len(known)}"
                )
            import_kv(self.kv_caches, held.block_table, kv.data, start=held.num_cached_tokens)
        except BaseException:
            self.block_manager.free(held.block_table)
            raise
        req = Request(
            rid,
            list(request.prompt_token_ids),
            request.params,
            request.seed,
            arrival,
            block_table=held.block_table,
            num_cached_tokens=kv.num_cached_tokens,
        )
        if request.resume is not None:
            req.resume_from(request.resume)
        req.output_token_ids += first.token_ids
        req.num_computed_tokens = len(known)
        req.logprobs = list(first.logprobs or [])
        # The text the prefill rank already sent: recomputed from the tokens, stop strings
        # included (the same function of the same tokens gives the same text).
        update_text(req, tokenizer, finished=False)
        req.num_tokens_sent, req.num_text_sent = len(req.output_token_ids), len(req.text)
        self.block_manager.commit(held.block_table, req.all_token_ids, req.num_computed_tokens)
        return req
