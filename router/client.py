"""Client library for the router: InferenceClient (blocking) and AsyncInferenceClient (asyncio).

Prompts are text or token ids, sampling options engine.SamplingParams. `generate` streams the
protobuf responses (the returned object is also the gRPC call: `.cancel()` stops the request and
frees its KV cache); `complete` gathers them into one engine.RequestOutput, as `LLM.generate`
returns. Failures raise grpc.RpcError (.code(), .details() says what to fix). `security`
(router.auth.ClientSecurity): TLS and the bearer token of a router that requires them.
"""

from collections.abc import AsyncIterator, Iterable, Iterator

from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.messages import ClusterStatus, ModelInfo, PoolLoad, RebalanceStatus, RequestOutput
from engine.sampling_params import SamplingParams
from router import auth
from router.api import convert, convert_status
from router.auth import ClientSecurity
from router.proto import epcluster_pb2 as pb
from router.proto import epcluster_pb2_grpc as pb_grpc

Prompt = str | list[int]


def _accumulate(acc: RequestOutput | None, msg: pb.GenerateResponse) -> RequestOutput:
    delta = convert.output_from_proto(msg)
    return delta if acc is None else acc.merge(delta)


def _gather(responses: Iterable[pb.GenerateResponse]) -> RequestOutput:
    acc = None
    for msg in responses:
        acc = _accumulate(acc, msg)
    return _finished(acc)


def _finished(acc: RequestOutput | None) -> RequestOutput:
    if acc is None or not acc.finished:
        raise RuntimeError("the router ended the stream without a finish reason")
    return acc


def _health_name(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class InferenceClient:
    """Blocking client. `timeout` is the default deadline (seconds) of every call."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        self.channel = auth.channel(target, security)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the responses; the iterator is also a grpc.Call (`.cancel()`)."""
        request = convert.generate_request_to_proto(prompt, params, request_id)
        return self.stub.Generate(request, timeout=self.timeout if timeout is None else timeout)

    def complete(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        """The whole output: text, token ids, finish reason, counts (and logprobs if asked)."""
        return _gather(self.generate(prompt, params, request_id=request_id, timeout=timeout))

    def model_info(self) -> ModelInfo:
        msg = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)
        return convert_status.model_info_from_proto(msg)

    def cluster_status(self) -> ClusterStatus:
        msg = self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=self.timeout)
        return convert_status.cluster_status_from_proto(msg)

    def expert_load(self) -> list[PoolLoad]:
        msg = self.stub.GetExpertLoad(pb.GetExpertLoadRequest(), timeout=self.timeout)
        return convert_status.expert_load_from_proto(msg)

    def rebalance(
        self, pool: str | None = None, timeout: float | None = None
    ) -> list[tuple[str, RebalanceStatus]]:
        """Re-place the experts of `pool` (None: both) now; -> each pool's outcome."""
        request = pb.RebalanceRequest(pool=pool) if pool else pb.RebalanceRequest()
        msg = self.stub.Rebalance(request, timeout=timeout or self.timeout)
        return convert_status.rebalance_response_from_proto(msg)

    def health(self, service: str = "") -> str:
        """The service's status name: SERVING, NOT_SERVING, ... (service "" is the whole
        server; "epcluster.v1.Inference" the Inference service)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return _health_name(self.health_stub.Check(request, timeout=self.timeout))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "InferenceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncInferenceClient:
    """asyncio client (create it inside the event loop that uses it)."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        self.channel = auth.aio_channel(target, security)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the responses (`async for`); the iterator is also a grpc.aio.Call."""
        request = convert.generate_request_to_proto(prompt, params, request_id)
        return self.stub.Generate(request, timeout=self.timeout if timeout is None else timeout)

    async def complete(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestOutput:
        acc = None
        async for msg in self.generate(prompt, params, request_id=request_id, timeout=timeout):
            acc = _accumulate(acc, msg)
        return _finished(acc)

    async def model_info(self) -> ModelInfo:
        msg = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)
        return convert_status.model_info_from_proto(msg)

    async def cluster_status(self) -> ClusterStatus:
        msg = await self.stub.GetClusterStatus(pb.GetClusterStatusRequest(), timeout=self.timeout)
        return convert_status.cluster_status_from_proto(msg)

    async def health(self, service: str = "") -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        return _health_name(await self.health_stub.Check(request, timeout=self.timeout))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncInferenceClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
