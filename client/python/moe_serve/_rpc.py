"""The moe.v1 methods as typed gRPC callables, on blocking (grpc) and asyncio (grpc.aio) channels.

moe_pb2_grpc's stubs are typed for blocking channels only (moe_pb2_grpc.pyi); these make the same
callables (method paths from the proto's descriptors, the messages' own (de)serializers) with
the request and response types that both kinds of channel carry.
"""

from __future__ import annotations

from typing import Type, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from ._stubs import moe_pb2

_Req = TypeVar("_Req", bound=Message)
_Resp = TypeVar("_Resp", bound=Message)

HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def method_path(service: str, method: str) -> str:
    """"/moe.v1.MoeService/Forward" from ("MoeService", "Forward"); KeyError for a name the proto
    does not have."""
    descriptor = moe_pb2.DESCRIPTOR.services_by_name[service]
    return f"/{descriptor.full_name}/{descriptor.methods_by_name[method].name}"


FORWARD = method_path("MoeService", "Forward")
FORWARD_STREAM = method_path("MoeService", "ForwardStream")
GET_MODEL_INFO = method_path("MoeService", "GetModelInfo")
GET_LOAD_BALANCE = method_path("MoeDiagnostics", "GetLoadBalance")
GET_PLACEMENT_ADVICE = method_path("MoeDiagnostics", "GetPlacementAdvice")
SET_ROUTER_BIAS = method_path("MoeDiagnostics", "SetRouterBias")


def _raw(data: bytes) -> bytes:
    """grpc.health.v1 messages travel as bytes (client.health_status decodes them)."""
    return data


def _unary(channel: grpc.Channel, path: str, request: Type[_Req],
           response: Type[_Resp]) -> grpc.UnaryUnaryMultiCallable[_Req, _Resp]:
    return channel.unary_unary(path, request_serializer=request.SerializeToString,
                               response_deserializer=response.FromString)


def _aio_unary(channel: grpc.aio.Channel, path: str, request: Type[_Req],
               response: Type[_Resp]) -> grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]:
    return channel.unary_unary(path, request_serializer=request.SerializeToString,
                               response_deserializer=response.FromString)


class Rpc:
    """The calls on blocking channels: `service` (forwards) and `plain` (everything else)."""

    def __init__(self, service: grpc.Channel, plain: grpc.Channel):
        self.forward = _unary(service, FORWARD, moe_pb2.ForwardRequest, moe_pb2.ForwardResponse)
        self.forward_stream: grpc.StreamStreamMultiCallable[moe_pb2.ForwardRequest, moe_pb2.ForwardResponse] = \
            service.stream_stream(FORWARD_STREAM, request_serializer=moe_pb2.ForwardRequest.SerializeToString,
                                  response_deserializer=moe_pb2.ForwardResponse.FromString)
        self.model_info = _unary(plain, GET_MODEL_INFO, moe_pb2.GetModelInfoRequest, moe_pb2.ModelInfo)
        self.load_balance = _unary(plain, GET_LOAD_BALANCE, moe_pb2.GetLoadBalanceRequest,
                                   moe_pb2.LoadBalanceReport)
        self.placement_advice = _unary(plain, GET_PLACEMENT_ADVICE, moe_pb2.GetPlacementAdviceRequest,
                                       moe_pb2.PlacementAdvice)
        self.set_router_bias = _unary(plain, SET_ROUTER_BIAS, moe_pb2.SetRouterBiasRequest,
                                      moe_pb2.SetRouterBiasResponse)
        self.health_check = plain.unary_unary(HEALTH_CHECK, request_serializer=_raw, response_deserializer=_raw)


class AioRpc:
    """Rpc's twin on grpc.aio channels."""

    def __init__(self, service: grpc.aio.Channel, plain: grpc.aio.Channel):
        self.forward = _aio_unary(service, FORWARD, moe_pb2.ForwardRequest, moe_pb2.ForwardResponse)
        self.forward_stream: grpc.aio.StreamStreamMultiCallable[moe_pb2.ForwardRequest, moe_pb2.ForwardResponse] = \
            service.stream_stream(FORWARD_STREAM, request_serializer=moe_pb2.ForwardRequest.SerializeToString,
                                  response_deserializer=moe_pb2.ForwardResponse.FromString)
        self.model_info = _aio_unary(plain, GET_MODEL_INFO, moe_pb2.GetModelInfoRequest, moe_pb2.ModelInfo)
        self.load_balance = _aio_unary(plain, GET_LOAD_BALANCE, moe_pb2.GetLoadBalanceRequest,
                                       moe_pb2.LoadBalanceReport)
        self.placement_advice = _aio_unary(plain, GET_PLACEMENT_ADVICE, moe_pb2.GetPlacementAdviceRequest,
                                           moe_pb2.PlacementAdvice)
        self.set_router_bias = _aio_unary(plain, SET_ROUTER_BIAS, moe_pb2.SetRouterBiasRequest,
                                          moe_pb2.SetRouterBiasResponse)
        self.health_check = plain.unary_unary(HEALTH_CHECK, request_serializer=_raw, response_deserializer=_raw)
