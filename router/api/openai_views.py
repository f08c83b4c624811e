"""The JSON of OpenAI's completions and chat completions (whole, and as server-sent events) for
router/api/openai_http.py, from the frontend's RequestOutputs; and its error envelope."""

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request

from engine.messages import RequestOutput
from engine.tokenizer import Tokenizer
from router.frontend import Refused

Deltas = AsyncGenerator[RequestOutput, None]  # one request's stream from Frontend.generate

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "INTERNAL": 500,
    "UNAUTHENTICATED": 401,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
    500: "internal_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


class OpenAIView:
    """OpenAI's JSON for one request's choices."""

    def __init__(
        self,
        model_name: str,
        tokenizer: Tokenizer,
        ident: str,
        created: int,
        chat: bool,
        body: dict[str, Any],
    ) -> None:
        self.model_name, self.ident, self.created, self.chat = model_name, ident, created, chat
        self.top = body.get("top_logprobs") or 0 if chat else body.get("logprobs") or 0
        self.tokenizer = tokenizer

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model_name,
        }

    def _logprobs(self, out: RequestOutput) -> dict | None:
        if out.logprobs is None:
            return None
        word = lambda t: self.tokenizer.decode([t])
        if self.chat:
            return {
                "content": [
                    {
                        "token": word(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(word(lp.token_id).encode()),
                        "top_logprobs": [
                            {"token": word(t), "logprob": v, "bytes": list(word(t).encode())}
                            for t, v in lp.top
                        ],
                    }
                    for lp in out.logprobs
                ]
            }
        return {
            "tokens": [word(lp.token_id) for lp in out.logprobs],
            "token_logprobs": [lp.logprob for lp in out.logprobs],
            "top_logprobs": [{word(t): v for t, v in lp.top} for lp in out.logprobs],
            "text_offset": [],
        }

    def _choice(self, i: int, out: RequestOutput, delta: bool, first: bool = False) -> dict:
        reason = out.finish_reason
        if self.chat:
            if delta:
                d = {"role": "assistant", "content": out.text} if first else {"content": out.text}
                body = {"delta": d if (out.text or first) else {}}
            else:
                body = {"message": {"role": "assistant", "content": out.text}}
        else:
            body = {"text": out.text}
        return {"index": i, **body, "logprobs": self._logprobs(out), "finish_reason": reason}

    @staticmethod
    def _usage(outs: list[RequestOutput]) -> dict:
        prompt = sum(o.num_prompt_tokens for o in outs)
        done = sum(o.num_completion_tokens for o in outs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
        }

    def whole(self, outs: list[RequestOutput]) -> dict:
        return {
            **self._head(False),
            "choices": [self._choice(i, o, delta=False) for i, o in enumerate(outs)],
            "usage": self._usage(outs),
        }

    async def sse(
        self, firsts: list[RequestOutput], streams: list[Deltas], usage: bool
    ) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()
        latest: dict[int, RequestOutput] = {}

        async def pump(i: int, first: RequestOutput, stream: Deltas) -> None:
            try:
                await queue.put((i, first))
                async for out in stream:
                    await queue.put((i, out))
            except Refused as e:
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [
            asyncio.create_task(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))
        ]
        started: set[int] = set()
        try:
            open_streams = len(tasks)
            while open_streams:
                i, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, Refused):
                    yield _event(
                        error_body(
                            HTTP_STATUS.get(item.status, 500), item.message, code=item.status
                        )
                    )
                    continue
                latest[i] = item
                chunk = {
                    **self._head(True),
                    "choices": [self._choice(i, item, delta=True, first=i not in started)],
                }
                started.add(i)
                if usage:
                    chunk["usage"] = None
                yield _event(chunk)
            if usage:
                yield _event(
                    {**self._head(True), "choices": [], "usage": self._usage(list(latest.values()))}
                )
            yield "data: [DONE]\n\n"
        finally:  # the client went away, or the stream ended: end every request
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            for s in streams:
                await s.aclose()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def gather(first: RequestOutput, stream: Deltas) -> RequestOutput:
    acc = first
    async for out in stream:
        acc = acc.merge(out)
    return acc


async def gather_or_disconnect(
    request: Request, firsts: list[RequestOutput], streams: list, poll_s: float
) -> list[RequestOutput] | None:
    """Each stream's whole output, or None when the client disconnected first; either way every
    stream is closed (a closed stream aborts its request and frees its blocks). NOTE: Starlette
    does not cancel a non-streaming endpoint whose client left: without this watch such a
    request generated to its end (a chat with no max_tokens: to the context), holding its
    admission slot and its KV blocks."""
    work = asyncio.ensure_future(asyncio.gather(*(gather(f, s) for f, s in zip(firsts, streams))))
    watch = asyncio.ensure_future(_disconnected(request, poll_s))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        return None
    finally:
        for task in (watch, work):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for s in streams:
            await s.aclose()


async def _disconnected(request: Request, poll_s: float) -> None:
    """Returns once the client has gone: the body is read, so the next ASGI message is
    http.disconnect (uvicorn sends it when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(poll_s)  # not expected after the body; never spin
