"""Registering a gRPC service so that a request that does not parse is a client error.

grpcio's generated `add_*Servicer_to_server` deserializes with `Message.FromString`; when that
raises (a string field holding invalid UTF-8, a truncated message), grpcio answers UNKNOWN with
the exception's class in the details. Here the deserializer keeps the failure, and the method
answers INVALID_ARGUMENT naming the message type and what was wrong, before the servicer runs.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message, message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor


@dataclass(frozen=True, slots=True)
class _Unparsed:
    type_name: str
    error: str


def _lenient(cls: type[message.Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except message.DecodeError as e:
            return _Unparsed(cls.DESCRIPTOR.full_name, str(e))

    return parse


def _checked(
    behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Unparsed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid {request.type_name}: {request.error}",
            )
        return await behavior(request, context)

    return run


def _handler(servicer: object, method: MethodDescriptor) -> grpc.RpcMethodHandler:
    if method.client_streaming:
        raise NotImplementedError(f"{method.full_name}: client streaming is not used here")
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    make = (
        grpc.unary_stream_rpc_method_handler
        if method.server_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        _checked(getattr(servicer, method.name)),
        request_deserializer=_lenient(request_cls),
        response_serializer=response_cls.SerializeToString,
    )


def add_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Serve every method of `service` from the servicer's method of the same name (an async
    function that writes its stream with context.write, or returns its one response)."""
    handlers = {m.name: _handler(servicer, m) for m in service.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
