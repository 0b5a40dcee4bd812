"""Serve a gRPC service whose requests are decoded inside the handler, not before it.

grpc.aio deserializes a request before the handler runs; bytes that do not parse then end
the call as UNKNOWN ("Unexpected DecodeError"), which tells a client nothing. Here every
method is registered with no deserializer (the handler receives the raw bytes) and decodes
them itself: undecodable bytes end the call with INVALID_ARGUMENT naming the method and the
message type. Streams decode each message as it is read; a bad one ends the stream the same
way. Handlers are built from the service's own descriptor, so every method is covered.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from lpsync.errors import InvalidArgumentError


def undecodable(method: MethodDescriptor, size: int, error: Exception) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{method.name}: the request's {size} bytes are not a valid "
        f"{method.input_type.full_name} message ({error or 'malformed protobuf'})"
    )


def decode(kind: type[Message], method: MethodDescriptor, raw: bytes) -> Message:
    try:
        return kind.FromString(raw)
    except (DecodeError, ValueError) as error:
        raise undecodable(method, len(raw), error) from None


def add_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Register ``servicer``'s implementation of every method of ``service``."""
    handlers = {m.name: _handler(servicer, m) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _handler(servicer: object, method: MethodDescriptor) -> grpc.RpcMethodHandler:
    kind = message_factory.GetMessageClass(method.input_type)
    impl: Callable = getattr(servicer, method.name)

    async def read(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            return decode(kind, method, raw)
        except InvalidArgumentError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            raise  # unreachable: abort raises

    async def decoded(raws: AsyncIterator[bytes]) -> AsyncIterator[Message]:
        # A bad message raises InvalidArgumentError to the handler reading the stream.
        async for raw in raws:
            yield decode(kind, method, raw)

    if not method.client_streaming and not method.server_streaming:

        async def unary_unary(raw: bytes, context):
            return await impl(await read(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=_serialize)
    if not method.client_streaming and inspect.isasyncgenfunction(impl):

        async def unary_stream(raw: bytes, context):
            async for response in impl(await read(raw, context), context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=_serialize)
    if not method.client_streaming:

        async def unary_write(raw: bytes, context):  # writes with context.write (Health.Watch)
            await impl(await read(raw, context), context)

        return grpc.unary_stream_rpc_method_handler(unary_write, response_serializer=_serialize)
    if not method.server_streaming:

        async def stream_unary(raws, context):
            try:
                return await impl(decoded(raws), context)
            except InvalidArgumentError as error:  # a message of the stream did not decode
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

        return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=_serialize)

    async def stream_stream(raws, context):
        try:
            async for response in impl(decoded(raws), context):
                yield response
        except InvalidArgumentError as error:  # a message of the stream did not decode
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))

    return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=_serialize)
