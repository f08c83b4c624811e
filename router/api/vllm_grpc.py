"""vLLM's engine gRPC protocol (`vllm.grpc.engine.VllmEngine`, from the smg-grpc-proto package),
the one gateways such as smg speak to engines, served by the router beside epcluster.v1 over the
same request path (router/frontend.py).

Generate takes token ids (or text) and streams token ids: with `stream`, a chunk per delta, then
a closing `complete` (finish reason and counts; its output_ids empty: gateways read the tokens
from the chunks); without, one `complete` with every token. Abort, HealthCheck, GetModelInfo,
GetServerInfo, GetLoads (one entry per rank of the pools) and GetTokenizer (the checkpoint's
tokenizer files, zipped) are answered; what epcluster cannot honour (embeddings, n > 1,
penalties, grammars, logit bias, prompt logprobs, multimodal inputs, KV-transfer parameters) is
refused with a clear INVALID_ARGUMENT or UNIMPLEMENTED, never ignored.
"""

import asyncio
import contextlib
import datetime
import hashlib
import io
import time
import zipfile
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.messages import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from router.api.abort_scope import AbortScope
from router.api.convert import check_bounds, conversion_cost
from router.frontend import Frontend, Refused, off_loop
from router.requests import InvalidField, make_request

SERVICE = vpb.DESCRIPTOR.services_by_name["VllmEngine"]
Context = grpc.aio.ServicerContext
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_UNSUPPORTED = grpc.StatusCode.UNIMPLEMENTED
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


class VllmEngineServicer:
    def __init__(self, frontend: Frontend, model_name: str, checkpoint: Path | None) -> None:
        self.frontend, self.backend = frontend, frontend.backend
        self.model_name, self.checkpoint = model_name, checkpoint
        self.started = time.time()
        self.last_request = 0.0
        self._tokenizer_zip: asyncio.Task | None = None  # built once, off the loop
        self.aborts = AbortScope(frontend)  # the router sets its security (server.py)

    # ---- Generate ----

    async def Generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        start = time.monotonic()
        self.last_request = time.time()
        remaining = context.time_remaining()  # the client's deadline, as epcluster.v1 takes it
        deadline = time.time() + remaining if remaining is not None else None
        try:
            # text tokenized, or token ids checked one by one (~1M in a 4 MiB message)
            req = await off_loop(conversion_cost(request), self._request, request, deadline)
            self.aborts.started(req.request_id, context)  # Abort: its owner, or the admin
        except ValueError as e:
            self.frontend.refuse("INVALID_ARGUMENT", str(e))
            await context.abort(_INVALID, str(e))
        except NotImplementedError as e:
            await context.abort(_UNSUPPORTED, str(e))
        stream = request.stream
        tokens: list[int] = []
        logprobs: list = []
        try:
            async with contextlib.aclosing(self.frontend.generate(req, start)) as deltas:
                async for out in deltas:
                    if stream and (out.token_ids or not out.finished):
                        await context.write(vpb.GenerateResponse(chunk=_chunk(out)))
                    if not stream:
                        tokens += out.token_ids
                        logprobs += out.logprobs or []
                    if out.finished:  # streamed: the tokens went in chunks
                        complete = _complete(out, tokens, logprobs)
                        await context.write(vpb.GenerateResponse(complete=complete))
        except Refused as e:
            await context.abort(grpc.StatusCode[e.status], e.message)

    def _request(self, msg: vpb.GenerateRequest, deadline: float | None) -> GenerateRequest:
        """vLLM's wire fields -> router/requests.py's make_request, or ValueError /
        NotImplementedError."""
        for field, what in (
            ("mm_inputs", "multimodal inputs"),
            ("media_refs", "media refs"),
            ("kv_transfer_params", "KV-transfer parameters"),
            ("kv_transfer_params_json", "KV-transfer parameters"),
        ):
            if msg.HasField(field):
                raise NotImplementedError(f"{what} are not supported by epcluster")
        if msg.extra_mm_inputs:
            raise NotImplementedError("multimodal inputs are not supported by epcluster")
        kind = msg.WhichOneof("input")
        if kind == "tokenized":
            ids = list(msg.tokenized.input_ids)
        elif kind == "text":
            ids = self.backend.tokenizer.encode(msg.text)
        else:
            raise ValueError("no input: set `tokenized` or `text`")
        params = sampling_params(msg.sampling_params)
        request_id = msg.request_id or None  # proto3: "" is unset
        try:
            return make_request(request_id, ids, params, self.backend.prompt_limits(), deadline)
        except InvalidField as e:
            if e.field == "stop_token_ids":
                raise ValueError(f"sampling_params: {e}") from None
            raise

    # ---- the rest ----

    async def Embed(self, request: vpb.EmbedRequest, context: Context) -> None:
        await context.abort(_UNSUPPORTED, "epcluster serves generation models: no embeddings")

    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: Context
    ) -> vpb.HealthCheckResponse:
        ready = self.backend.ready() and not self.frontend.draining
        why = "ok" if ready else ("draining" if self.frontend.draining else "not ready")
        return vpb.HealthCheckResponse(healthy=ready, message=why)

    async def Abort(self, request: vpb.AbortRequest, context: Context) -> vpb.AbortResponse:
        refusal = self.aborts.refusal(request.request_ids, context)
        if refusal is not None:  # another caller's request, and no admin token
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        for rid in request.request_ids:
            await self.backend.abort(rid)
        return vpb.AbortResponse()

    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: Context
    ) -> vpb.GetModelInfoResponse:
        info = self.backend.model_info()
        limits = self.backend.prompt_limits()
        eos = [] if info.eos_token_id is None else [info.eos_token_id]
        # NOTE: the model's name, never the router's checkpoint directory: an absolute path on
        # the router's host is none of a client's business (the files come from GetTokenizer).
        return vpb.GetModelInfoResponse(
            model_path=self.model_name,
            is_generation=True,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            served_model_name=self.model_name,
            tokenizer_path=self.model_name,
            model_type=info.model_type,
            eos_token_ids=eos,
            max_req_input_len=limits.max_prompt_tokens,
        )

    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: Context
    ) -> vpb.GetServerInfoResponse:
        return vpb.GetServerInfoResponse(
            active_requests=len(self.frontend.in_flight),
            is_paused=self.frontend.draining,
            last_receive_timestamp=self.last_request,
            uptime_seconds=time.time() - self.started,
            server_type="vllm-grpc",
            block_size=self.backend.prompt_limits().block_size,
            data_parallel_size=1,
        )

    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: Context
    ) -> vpb.GetLoadsResponse:
        status = await self.backend.status()
        loads = []
        for i, rank in enumerate(r for p in status.pools for r in p.ranks):
            total = rank.kv_total_blocks * self.backend.prompt_limits().block_size
            used = rank.kv_used_blocks * self.backend.prompt_limits().block_size
            loads.append(
                vpb.SchedulerLoad(
                    dp_rank=i,
                    num_running_reqs=rank.num_running,
                    num_waiting_reqs=rank.num_waiting,
                    num_total_reqs=rank.num_running + rank.num_waiting,
                    num_used_tokens=used,
                    max_total_num_tokens=total,
                    token_usage=used / total if total else 0.0,
                )
            )
        if request.HasField("dp_rank"):
            loads = [x for x in loads if x.dp_rank == request.dp_rank]
        return vpb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            version="epcluster",
            dp_rank_count=len(loads),
            loads=loads,
        )

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest, context: Context) -> None:
        if self.checkpoint is None:
            await context.abort(_UNSUPPORTED, "this router has no checkpoint directory")
        # NOTE: zipping V3's 8 MB tokenizer.json took ~0.5 s, once per call on the router's loop;
        # now once per router, on a thread (the files do not change while it serves).
        if self._tokenizer_zip is None or (
            self._tokenizer_zip.done() and self._tokenizer_zip.exception() is not None
        ):
            self._tokenizer_zip = asyncio.ensure_future(
                asyncio.to_thread(tokenizer_zip, self.checkpoint)
            )
        data, digest = await asyncio.shield(self._tokenizer_zip)
        step = 1 << 20
        for off in range(0, len(data), step):
            last = off + step >= len(data)
            await context.write(
                common_pb2.GetTokenizerChunk(
                    data=data[off : off + step], sha256=digest if last else ""
                )
            )

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        return common_pb2.FlushCacheResponse(success=False, message="not supported by epcluster")

    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message="not supported by epcluster")

    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: Context
    ) -> common_pb2.ProfileResponse:
        return common_pb2.ProfileResponse(success=False, message="not supported by epcluster")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> None:
        await context.abort(_UNSUPPORTED, "epcluster publishes no KV cache events")


def tokenizer_zip(checkpoint: Path) -> tuple[bytes, str]:
    """The checkpoint's tokenizer files zipped (GetTokenizer's payload), and its sha256."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                z.write(checkpoint / name, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def sampling_params(p: vpb.SamplingParams) -> SamplingParams:
    """vLLM's proto sampling fields -> SamplingParams (proto3 zeros mean unset; no seed: None,
    make_request draws one)."""
    refused = {
        "n": p.n > 1,
        "frequency_penalty": p.frequency_penalty != 0,
        "presence_penalty": p.presence_penalty != 0,
        "repetition_penalty": p.repetition_penalty not in (0, 1),
        "min_tokens": p.min_tokens > 0,
        "logit_bias": bool(p.logit_bias),
        "prompt_logprobs": p.HasField("prompt_logprobs"),
        "truncate_prompt_tokens": p.HasField("truncate_prompt_tokens"),
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "constraint": p.WhichOneof("constraint") is not None,
    }
    for name, bad in refused.items():
        if bad:
            raise NotImplementedError(f"sampling_params.{name} is not supported by epcluster")
    fields = {
        "temperature": p.temperature if p.HasField("temperature") else 1.0,
        "top_p": p.top_p or 1.0,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "seed": p.seed if p.HasField("seed") else None,
        # vLLM: unset means up to the context
        "max_tokens": p.max_tokens if p.HasField("max_tokens") else 1 << 30,
    }
    if p.HasField("logprobs"):
        fields["logprobs"] = p.logprobs
    try:
        check_bounds(fields)  # uint32 top_k / max_tokens past int32; the same rules everywhere
        return SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"sampling_params: {e}") from None


def _logprobs(lps: list) -> vpb.OutputLogProbs | None:
    if not lps:
        return None
    return vpb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in lps],
        token_ids=[lp.token_id for lp in lps],
        top_logprobs=[
            vpb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])
            for lp in lps
        ],
    )


def _chunk(out: RequestOutput) -> vpb.GenerateStreamChunk:
    return vpb.GenerateStreamChunk(
        token_ids=out.token_ids,
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_completion_tokens,
        cached_tokens=out.num_cached_tokens,
        output_logprobs=_logprobs(out.logprobs or []),
    )


def _complete(out: RequestOutput, ids: list[int], lps: list) -> vpb.GenerateComplete:
    return vpb.GenerateComplete(
        output_ids=ids,
        finish_reason=out.finish_reason,
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_completion_tokens,
        cached_tokens=out.num_cached_tokens,
        output_logprobs=_logprobs(lps),
    )
