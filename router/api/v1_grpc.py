"""The epcluster.v1.Inference service (router/proto/epcluster.proto): Generate validates
(INVALID_ARGUMENT), then takes router/frontend.py's request path (admission, readiness,
streaming, aborts on early ends), its refusals as gRPC statuses; the admin calls (model info,
expert load, rebalance, cluster status) go to the backend."""

import contextlib
import time

import grpc

from router.api import convert, convert_status
from router.backend import Unavailable
from router.frontend import Frontend, Refused, off_loop
from router.proto import epcluster_pb2 as pb
from router.proto import epcluster_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]
SERVICE_NAME = SERVICE.full_name  # "epcluster.v1.Inference"
RETRY_PUSHBACK = "grpc-retry-pushback-ms"  # how long a client should wait before a retry
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.backend = frontend.backend

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        start = time.monotonic()
        if self.frontend.draining:  # before parsing: a router that stops answers at once
            why = "this router is shutting down: retry (on another router)"
            await _abort(context, self.frontend.refuse("UNAVAILABLE", why, "draining", 1.0))
        remaining = context.time_remaining()
        deadline = time.time() + remaining if remaining is not None else None
        try:
            text = convert.conversion_cost(request)  # text chars or token ids (checked each)
            tokenizer, limits = self.backend.tokenizer, self.backend.prompt_limits()
            build = convert.generate_request_from_proto
            req = await off_loop(text, build, request, tokenizer, limits, deadline)
        except ValueError as e:
            await _abort(context, self.frontend.refuse("INVALID_ARGUMENT", str(e)))
        sent = False
        try:
            async with contextlib.aclosing(self.frontend.generate(req, start)) as deltas:
                async for out in deltas:
                    ttft = None
                    if out.token_ids and not sent:
                        ttft, sent = time.monotonic() - start, True
                    await context.write(convert.output_to_proto(out, ttft))
        except Refused as e:
            await _abort(context, e)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        await _reject_unknown_fields(request, context)
        return convert_status.model_info_to_proto(self.backend.model_info())

    async def GetExpertLoad(
        self, request: pb.GetExpertLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExpertLoad:
        await _reject_unknown_fields(request, context)
        try:
            return convert_status.expert_load_to_proto(await self.backend.expert_load())
        except Unavailable as e:  # a rank failed: the pool re-forms (not UNKNOWN)
            await context.abort(grpc.StatusCode.UNAVAILABLE, _one_line(e))

    async def Rebalance(
        self, request: pb.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.RebalanceResponse:
        await _reject_unknown_fields(request, context)
        pool = request.pool if request.HasField("pool") else None
        if pool not in (None, "prefill", "decode"):
            await context.abort(_INVALID, f"pool must be prefill or decode, got {pool!r}")
        try:
            results = await self.backend.rebalance(pool)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _one_line(e))
        return convert_status.rebalance_response_to_proto(results)

    async def GetClusterStatus(
        self, request: pb.GetClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClusterStatus:
        await _reject_unknown_fields(request, context)
        try:
            status = await self.backend.status()
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _one_line(e))
        status.num_queued = self.frontend.admission.num_requests
        status.num_queued_tokens = self.frontend.admission.num_tokens
        return convert_status.cluster_status_to_proto(status)


async def _abort(context: grpc.aio.ServicerContext, e: Refused) -> None:
    """End the call with the refusal's status (and a retry hint where it has one)."""
    hint = () if e.retry_after_s is None else ((RETRY_PUSHBACK, str(int(e.retry_after_s * 1e3))),)
    await context.abort(grpc.StatusCode[e.status], e.message, trailing_metadata=hint)


def _one_line(e: Exception) -> str:
    """An error's first line: a status message, never a traceback."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


async def _reject_unknown_fields(request: object, context: grpc.aio.ServicerContext) -> None:
    unknown = convert.unknown_fields(request)
    if unknown:
        await context.abort(_INVALID, f"request has fields this server does not know: {unknown}")
