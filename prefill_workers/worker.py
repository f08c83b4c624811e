"""PrefillWorker: one prefill rank. The engine runs each prompt as a prefill-only request; when
its first token is sampled, the prompt's latent KV is exported and the blocks go back to the
prefix cache."""

import asyncio
from typing import Any

from engine.messages import GenerateRequest
from engine.rank import Rank, RankConfig
from engine.request import PREFILLED, RequestOutput


class PrefillWorker(Rank):
    def __init__(self, config: RankConfig) -> None:
        super().__init__(config)
        self._waiting: dict[str, asyncio.Future] = {}  # request id -> its first delta
        self.num_prompt_tokens_in_flight = 0

    async def prefill(self, request: GenerateRequest, kv_dst: int = 0) -> tuple[RequestOutput, Any]:
        """Run the prompt; -> (first delta, the transport's handle of the prompt's KV for the
        decode rank). The handle is None when the request already finished with its first token
        (EOS, max_tokens=1, a stop). kv_dst: the decode rank's index in the KV transport group.
        """
        rid = request.request_id
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        self.num_prompt_tokens_in_flight += len(request.prompt_token_ids)
        try:
            await self.call(
                lambda e: e.add_request(
                    rid,
                    request.prompt_token_ids,
                    request.params,
                    seed=request.seed,
                    prefill_only=True,
                )
            )
            first: RequestOutput = await future
        except BaseException:  # cancelled or failed: the prompt must not hold blocks
            await asyncio.shield(self.abort(rid))
            raise
        finally:
            self._waiting.pop(rid, None)
            self.num_prompt_tokens_in_flight -= len(request.prompt_token_ids)
        if first.finish_reason != PREFILLED:
            return first, None
        kv = self.engine.exported.pop(rid)  # set on the engine thread before this delta was sent
        first.finish_reason = None  # the decode rank carries on
        return first, self.transport.send(kv, kv_dst)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for delta in outputs:
            future = self._waiting.get(delta.request_id)
            if future is not None and not future.done() and delta.finished:
                future.set_result(delta)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: (e.abort_request(request_id), e.exported.pop(request_id, None)))
