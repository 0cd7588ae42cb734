"""MoeClient (blocking) and AsyncMoeClient (asyncio) for the moe.v1 service.

    from moe_serve import MoeClient
    with MoeClient("localhost:50051") as client:
        y, routing = client.forward(1, x, return_routing=True)   # x: numpy or torch
        for y, _ in client.forward_stream(1, batches):           # ForwardStream, in order
            ...

Inputs are numpy arrays (float16/32/64, or ml_dtypes.bfloat16) or torch tensors, [T, H] or
[B, T, H]. The wire dtype defaults to the one that carries the input unchanged (bf16 for
torch.bfloat16 and ml_dtypes.bfloat16, fp16 for half, else fp32); the output comes back as the
same kind of array in `output_dtype` (default: the wire dtype; a numpy output is float32, or
float16 for fp16: a bf16 output decodes to float32, exactly). An input of another kind (a Python
list, an integer array) raises TypeError, one of another rank ValueError, before anything is
sent. Failed calls raise MoeError with the gRPC status code and the server's message.
"""

from __future__ import annotations

import asyncio
import collections.abc
import json
import socket
import threading
from typing import (Any, AsyncIterable, AsyncIterator, Dict, Generic, Iterable, Iterator, List, Literal,
                    Optional, Sequence, Tuple, TypeVar, Union, overload)

import grpc
import grpc.aio
import numpy as np
import numpy.typing as npt

from . import _rpc, _tensors
from ._stubs import moe_pb2
from ._tensors import DTypeName, Hidden, TensorIn

# grpc.health.v1.HealthCheckResponse.ServingStatus
_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
# Before the server's limits are known (GetModelInfo): gRPC's own default.
_BOOTSTRAP_MESSAGE_BYTES = 4 << 20
# Requests a forward_stream keeps unanswered at most (its responses are held to put them in order).
DEFAULT_MAX_IN_FLIGHT = 32

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Metadata = Tuple[Tuple[str, str], ...]
_ChannelOptions = List[Tuple[str, Any]]


class MoeError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _rpc_error(e: grpc.RpcError) -> MoeError:
    return MoeError(e.code(), e.details() or "")


def status_code(code: int) -> grpc.StatusCode:
    """grpc.StatusCode of a numeric code (RequestError.code); UNKNOWN for one gRPC does not have."""
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


class Routing:
    """Router choices: expert_ids int32 and weights float32, both [tokens, top_k]."""

    def __init__(self, top_k: int, expert_ids: npt.NDArray[np.int32], weights: npt.NDArray[np.float32]):
        self.top_k = top_k
        self.expert_ids = expert_ids
        self.weights = weights

    def __repr__(self) -> str:
        return f"Routing(top_k={self.top_k}, tokens={self.expert_ids.shape[0]})"


def message_limit(info: moe_pb2.ModelInfo) -> int:
    """The largest message the server's limits imply: a response to its largest request, an
    fp32 output of max_request_tokens x hidden plus routing, and 1 MiB of framing."""
    tokens = max(int(info.max_request_tokens), 1)
    return tokens * int(info.hidden_size) * 4 + tokens * max(int(info.top_k), 1) * 12 + (1 << 20)


def _read(path: Optional[str]) -> Optional[bytes]:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _read_token(token: Optional[str], token_file: Optional[str]) -> Optional[str]:
    if token is not None and token_file is not None:
        raise ValueError("give token or token_file, not both")
    if token_file is not None:
        with open(token_file, encoding="utf-8") as f:
            return f.read().strip()
    return token


def channel_target(targets: str) -> str:
    """The gRPC target for one gateway or several (as the C++ client's GatewayChannelTarget):
    "host:port" goes to gRPC's DNS resolver (every address the name has); "host:port,host:port"
    is resolved here, once, to "ipv4:IP:port,IP:port" (or ipv6:)."""
    targets = targets.strip()
    if not targets:
        raise ValueError("empty target (want HOST:PORT)")
    if "," not in targets:
        return targets
    v4: List[str] = []
    v6: List[str] = []
    for entry in (e.strip() for e in targets.split(",")):
        host, sep, port = entry.rpartition(":")
        if not entry or not sep or not port or not host:
            raise ValueError(f"gateway {entry!r} in {targets!r} is not HOST:PORT")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"gateway {entry!r} does not resolve: {e}") from None
        four = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET]
        six = [str(i[4][0]) for i in infos if i[0] == socket.AF_INET6]
        if four:
            v4.append(f"{four[0]}:{port}")
        if six:
            v6.append(f"[{six[0]}]:{port}")
    return "ipv4:" + ",".join(v4) if v4 else "ipv6:" + ",".join(v6)


def service_config(health_checked: bool, attempts: int = 4) -> str:
    """round_robin over the gateways (health_checked: only those whose "moe.v1.MoeService" health
    says SERVING), UNAVAILABLE retried on the next one (gRPC's retryPolicy)."""
    config: Dict[str, Any] = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{
            "name": [{"service": "moe.v1.MoeService"}, {"service": "moe.v1.MoeDiagnostics"},
                     {"service": "inference.GRPCInferenceService"}],
            "retryPolicy": {"maxAttempts": attempts, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
    }
    if health_checked:
        config["healthCheckConfig"] = {"serviceName": "moe.v1.MoeService"}
    return json.dumps(config)


class _Channels:
    """How to make a channel to the gateways (TLS files, limits, failover); both clients use it."""

    def __init__(self, target: str, tls: bool, tls_ca: Optional[str], tls_cert: Optional[str],
                 tls_key: Optional[str], tls_server_name: Optional[str]):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.target = channel_target(target)
        self.credentials: Optional[grpc.ChannelCredentials] = None
        self.extra_options: _ChannelOptions = []
        if "," in target:
            # An "ipv4:" list would lend the whole list as the authority TLS verifies: use the
            # first gateway's name (gateways behind one list share a certificate).
            self.extra_options.append(("grpc.default_authority", target.split(",")[0].strip()))
        if tls or tls_ca or tls_cert:
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca), private_key=_read(tls_key),
                certificate_chain=_read(tls_cert))
            if tls_server_name:
                self.extra_options.append(("grpc.ssl_target_name_override", tls_server_name))

    def options(self, limit: int, health_checked: bool) -> _ChannelOptions:
        return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
                ("grpc.service_config", service_config(health_checked)), ("grpc.enable_retries", 1),
                # gRPC retries only requests it kept (256 KiB by default): keep every one.
                ("grpc.per_rpc_retry_buffer_size", limit),
                # A hung gateway keeps its connection open: pings find it within about 3 s.
                ("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 1000),
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                *self.extra_options]

    # Forwards go on a health-checked channel (only gateways that take requests); health, model
    # info and diagnostics on one that reaches any gateway.
    def make(self, limit: int, health_checked: bool) -> grpc.Channel:
        options = self.options(limit, health_checked)
        if self.credentials is not None:
            return grpc.secure_channel(self.target, self.credentials, options=options)
        return grpc.insecure_channel(self.target, options=options)

    def make_aio(self, limit: int, health_checked: bool) -> grpc.aio.Channel:
        options = self.options(limit, health_checked)
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.target, self.credentials, options=options)
        return grpc.aio.insecure_channel(self.target, options=options)


def _request(layer: int, x: TensorIn, dtype: Optional[DTypeName], return_routing: bool,
             output_dtype: Optional[DTypeName], request_id: str) -> moe_pb2.ForwardRequest:
    _tensors.check_input(x)
    if len(x.shape) not in (2, 3):
        raise ValueError("hidden states must be [tokens, hidden] or [batch, tokens, hidden]; got shape "
                         f"{tuple(int(n) for n in x.shape)}")
    return moe_pb2.ForwardRequest(
        layer=layer, hidden_states=_tensors.encode_tensor(x, dtype), return_routing=return_routing,
        output_dtype=_tensors.wire_dtype(output_dtype) if output_dtype else moe_pb2.DTYPE_UNSPECIFIED,
        request_id=request_id)


def _result(response: moe_pb2.ForwardResponse, x: Hidden,
            return_routing: bool) -> Tuple[Hidden, Optional[Routing]]:
    y = _tensors.decode_tensor(response.output, like=x)
    routing = None
    if return_routing:
        k = response.routing.top_k
        ids = np.array(response.routing.expert_ids, dtype=np.int32)
        weights = np.array(response.routing.weights, dtype=np.float32)
        tokens = ids.size // k if k > 0 else 0
        routing = Routing(k, ids.reshape(tokens, k), weights.reshape(tokens, k))
    return y, routing


class _InOrder(Generic[Hidden]):
    """One ForwardStream's responses (which come as steps finish) put back in request order."""

    def __init__(self, return_routing: bool):
        self.return_routing = return_routing
        self.inputs: Dict[int, Hidden] = {}  # sent, not yet yielded (request_id = the index)
        self.sent = 0
        self.failure: Optional[Tuple[int, Exception]] = None  # an input that could not be sent
        self._responses: Dict[int, moe_pb2.ForwardResponse] = {}
        self._next = 0

    def add(self, response: moe_pb2.ForwardResponse) -> None:
        index = int(response.request_id) if response.request_id.isdigit() else -1
        if index not in self.inputs or index in self._responses:
            raise MoeError(grpc.StatusCode.INTERNAL,
                           f"ForwardStream answered request_id {response.request_id!r}, not one awaited")
        self._responses[index] = response

    def ready(self) -> Iterator[Tuple[Hidden, Optional[Routing]]]:
        """The results next in order that have come; MoeError at a request that failed."""
        while self._next in self._responses:
            response = self._responses.pop(self._next)
            x = self.inputs.pop(self._next)
            self._next += 1
            if response.HasField("error"):
                raise MoeError(status_code(response.error.code), response.error.message)
            yield _result(response, x, self.return_routing)

    def finish(self) -> None:
        """At the stream's end: raises what the input failing to be sent raised, or MoeError for
        requests left unanswered."""
        if self.failure is not None and self.failure[0] == self._next:
            raise self.failure[1]
        if self._next < self.sent:
            raise MoeError(grpc.StatusCode.INTERNAL,
                           f"ForwardStream ended with {self.sent - self._next} requests unanswered")


async def _items(xs: Union[Iterable[Hidden], AsyncIterable[Hidden]]) -> AsyncIterator[Hidden]:
    if isinstance(xs, collections.abc.AsyncIterable):
        async for x in xs:
            yield x
    else:
        for x in xs:
            yield x


def _health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest{service}, encoded by hand: generated grpc/health stubs
    would be a second copy of grpcio-health-checking's."""
    if not service:
        return b""
    raw = service.encode()
    out, n = bytearray([0x0A]), len(raw)
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + raw


def _read_varint(data: bytes, i: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint in health response")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def health_status(data: bytes) -> int:
    """grpc.health.v1.HealthCheckResponse bytes -> status number (field 1, varint)."""
    i, status = 0, 0
    while i < len(data):
        key, i = _read_varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
            if field == 1:
                status = value
        elif wire == 2:
            length, i = _read_varint(data, i)
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"malformed health response (wire type {wire})")
    return status


def _serving_status(data: bytes) -> str:
    status = health_status(data)
    return _SERVING_STATUS.get(status, f"UNKNOWN({status})")


def _check_window(max_in_flight: int) -> None:
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")


class _ClientBase:
    """The options both clients take (MoeClient's docstring)."""

    def __init__(self, target: str, *, tls: bool = False, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_server_name: Optional[str] = None, token: Optional[str] = None,
                 token_file: Optional[str] = None, max_message_bytes: Optional[int] = None):
        self.target = target
        self._channels = _Channels(target, tls, tls_ca, tls_cert, tls_key, tls_server_name)
        token = _read_token(token, token_file)
        # Per call, not as call credentials: gRPC sends those only over TLS, and a token on a
        # plaintext channel to a trusted network is a deployment's choice.
        self._metadata: Optional[_Metadata] = (("authorization", f"Bearer {token}"),) if token else None
        self._sized = max_message_bytes is not None
        self.max_message_bytes = max_message_bytes or _BOOTSTRAP_MESSAGE_BYTES


class MoeClient(_ClientBase):
    """A client of one moe.v1 gateway or several; safe to share between threads.

    `target` is "host:port" (a name with several addresses reaches them all) or
    "host:port,host:port,...": calls are spread over the gateways and one that finds its gateway
    gone (UNAVAILABLE) runs again on another (channel_target, service_config).

    TLS when `tls` or any tls_* file is given: tls_ca (PEM path) is the trust for the gateway's
    certificate (else the system's roots); tls_cert + tls_key, a client certificate for a
    gateway that requires mTLS. `token` (or `token_file`) goes with every call as
    `authorization: Bearer` (the gateway's --api-token-file or --admin-token-file).
    `max_message_bytes`: None sizes the channel from the server's GetModelInfo on first use,
    so a batch as large as the server takes is also one the client can receive.
    """

    def __init__(self, target: str, *, tls: bool = False, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_server_name: Optional[str] = None, token: Optional[str] = None,
                 token_file: Optional[str] = None, max_message_bytes: Optional[int] = None):
        super().__init__(target, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                         tls_server_name=tls_server_name, token=token, token_file=token_file,
                         max_message_bytes=max_message_bytes)
        self._size_lock = threading.Lock()
        # Channels replaced by a larger one stay open until close(): calls may still be on them.
        self._replaced: List[grpc.Channel] = []
        self._open(self.max_message_bytes)

    def _open(self, limit: int) -> None:
        self.max_message_bytes = limit
        self._channel = self._channels.make(limit, health_checked=True)
        self._plain = self._channels.make(limit, health_checked=False)
        self._rpc = _rpc.Rpc(self._channel, self._plain)

    def _call(self, method: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req,
              timeout: Optional[float]) -> _Resp:
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _rpc_error(e) from None

    def _size_from_server(self) -> None:
        with self._size_lock:
            if self._sized:
                return
            limit = message_limit(self.info())
            if limit > self.max_message_bytes:
                self._replaced += [self._channel, self._plain]
                self._open(limit)
            self._sized = True

    @overload
    def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None,
                return_routing: Literal[False] = False, output_dtype: Optional[DTypeName] = None,
                timeout: Optional[float] = None, request_id: str = "") -> Tuple[Hidden, None]: ...
    @overload
    def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None, *,
                return_routing: Literal[True], output_dtype: Optional[DTypeName] = None,
                timeout: Optional[float] = None, request_id: str = "") -> Tuple[Hidden, Routing]: ...
    @overload
    def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None, return_routing: bool = False,
                output_dtype: Optional[DTypeName] = None, timeout: Optional[float] = None,
                request_id: str = "") -> Tuple[Hidden, Optional[Routing]]: ...

    def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None, return_routing: bool = False,
                output_dtype: Optional[DTypeName] = None, timeout: Optional[float] = None,
                request_id: str = "") -> Tuple[Hidden, Optional[Routing]]:
        """Runs `layer` on x. Returns (output of x's shape and kind, Routing, or None unless
        return_routing)."""
        request = _request(layer, x, dtype, return_routing, output_dtype, request_id)
        self._size_from_server()
        return _result(self._call(self._rpc.forward, request, timeout), x, return_routing)

    @overload
    def forward_stream(self, layer: int, xs: Iterable[Hidden], *, dtype: Optional[DTypeName] = None,
                       return_routing: Literal[False] = False, output_dtype: Optional[DTypeName] = None,
                       timeout: Optional[float] = None,
                       max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> Iterator[Tuple[Hidden, None]]: ...
    @overload
    def forward_stream(self, layer: int, xs: Iterable[Hidden], *, dtype: Optional[DTypeName] = None,
                       return_routing: Literal[True], output_dtype: Optional[DTypeName] = None,
                       timeout: Optional[float] = None,
                       max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> Iterator[Tuple[Hidden, Routing]]: ...
    @overload
    def forward_stream(self, layer: int, xs: Iterable[Hidden], *, dtype: Optional[DTypeName] = None,
                       return_routing: bool = False, output_dtype: Optional[DTypeName] = None,
                       timeout: Optional[float] = None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
                       ) -> Iterator[Tuple[Hidden, Optional[Routing]]]: ...

    def forward_stream(self, layer: int, xs: Iterable[Hidden], *, dtype: Optional[DTypeName] = None,
                       return_routing: bool = False, output_dtype: Optional[DTypeName] = None,
                       timeout: Optional[float] = None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
                       ) -> Iterator[Tuple[Hidden, Optional[Routing]]]:
        """Runs `layer` on every x of `xs` over one ForwardStream: yields (output, Routing or
        None) per input, in the inputs' order, while later inputs are still running.

        `xs` is read as the stream goes, at most `max_in_flight` requests ahead of the results
        read. A request that fails raises MoeError where its result would come (the stream is
        then cancelled), an input that cannot be sent (TypeError, ValueError, or what iterating
        `xs` raised) likewise after the results before it; `timeout` is for the whole stream.
        Stopping early (break) cancels the stream.
        """
        _check_window(max_in_flight)
        return self._stream(layer, iter(xs), dtype, return_routing, output_dtype, timeout, max_in_flight)

    def _stream(self, layer: int, xs: Iterator[Hidden], dtype: Optional[DTypeName], return_routing: bool,
                output_dtype: Optional[DTypeName], timeout: Optional[float],
                max_in_flight: int) -> Iterator[Tuple[Hidden, Optional[Routing]]]:
        self._size_from_server()
        order: _InOrder[Hidden] = _InOrder(return_routing)
        window = threading.Semaphore(max_in_flight)
        closed = threading.Event()

        def requests() -> Iterator[moe_pb2.ForwardRequest]:  # on gRPC's thread
            index = 0
            while True:
                try:
                    x = next(xs)
                    request = _request(layer, x, dtype, return_routing, output_dtype, str(index))
                except StopIteration:
                    return
                except Exception as e:  # pylint: disable=broad-except  raised in order, in the reader
                    order.failure = (index, e)
                    return
                while not window.acquire(timeout=0.05):
                    if closed.is_set():
                        return
                if closed.is_set():
                    return
                order.inputs[index] = x
                order.sent = index + 1
                yield request
                index += 1

        call = self._rpc.forward_stream(requests(), timeout=timeout, metadata=self._metadata)
        try:
            for response in call:
                window.release()
                order.add(response)
                yield from order.ready()
            order.finish()
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        finally:
            # Cancel before the request generator may return: its return half-closes the stream,
            # and a server that saw the half-close first would finish the requests it had.
            call.cancel()
            closed.set()

    def info(self, timeout: Optional[float] = 10.0) -> moe_pb2.ModelInfo:
        """moe.v1.ModelInfo."""
        return self._call(self._rpc.model_info, moe_pb2.GetModelInfoRequest(), timeout)

    def load_balance(self, layer: int, timeout: Optional[float] = 10.0) -> moe_pb2.LoadBalanceReport:
        """MoeDiagnostics/GetLoadBalance (the admin token, when the gateway has one)."""
        return self._call(self._rpc.load_balance, moe_pb2.GetLoadBalanceRequest(layer=layer), timeout)

    def placement_advice(self, layer: int = -1, redundant_experts: int = 0,
                         timeout: Optional[float] = 30.0) -> moe_pb2.PlacementAdvice:
        """MoeDiagnostics/GetPlacementAdvice; layer < 0 sums every served layer's load."""
        request = moe_pb2.GetPlacementAdviceRequest(layer=layer, redundant_experts=redundant_experts)
        return self._call(self._rpc.placement_advice, request, timeout)

    def set_router_bias(self, layer: int, bias: Sequence[float], source: str = "moe_serve",
                        timeout: Optional[float] = 10.0) -> moe_pb2.SetRouterBiasResponse:
        """MoeDiagnostics/SetRouterBias; an empty `bias` restores the checkpoint's."""
        request = moe_pb2.SetRouterBiasRequest(layer=layer, bias=list(bias), source=source)
        return self._call(self._rpc.set_router_bias, request, timeout)

    def health(self, service: str = "", timeout: Optional[float] = 5.0) -> str:
        """"SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"; MoeError when the check
        fails (server down: UNAVAILABLE)."""
        try:
            data = self._rpc.health_check(_health_request(service), timeout=timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        return _serving_status(data)

    def close(self) -> None:
        for channel in [*self._replaced, self._channel, self._plain]:
            channel.close()

    def __enter__(self) -> MoeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncMoeClient(_ClientBase):
    """The asyncio twin of MoeClient (grpc.aio): the same arguments, awaitable calls, and
    forward_stream an async iterator (over an iterable or an async iterable of inputs).

        async with AsyncMoeClient("localhost:50051") as client:
            y, _ = await client.forward(1, x)
            async for y, _ in client.forward_stream(1, batches):
                ...
    """

    def __init__(self, target: str, *, tls: bool = False, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 tls_server_name: Optional[str] = None, token: Optional[str] = None,
                 token_file: Optional[str] = None, max_message_bytes: Optional[int] = None):
        super().__init__(target, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                         tls_server_name=tls_server_name, token=token, token_file=token_file,
                         max_message_bytes=max_message_bytes)
        self._size_lock: Optional[asyncio.Lock] = None  # made in the event loop, on first use
        self._replaced: List[grpc.aio.Channel] = []
        self._open(self.max_message_bytes)

    def _open(self, limit: int) -> None:
        self.max_message_bytes = limit
        self._channel = self._channels.make_aio(limit, health_checked=True)
        self._plain = self._channels.make_aio(limit, health_checked=False)
        self._rpc = _rpc.AioRpc(self._channel, self._plain)

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req,
                    timeout: Optional[float]) -> _Resp:
        try:
            return await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _rpc_error(e) from None

    async def _size_from_server(self) -> None:
        if self._sized:
            return
        if self._size_lock is None:
            self._size_lock = asyncio.Lock()
        async with self._size_lock:
            if self._sized:
                return
            limit = message_limit(await self.info())
            if limit > self.max_message_bytes:
                self._replaced += [self._channel, self._plain]
                self._open(limit)
            self._sized = True

    @overload
    async def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None,
                      return_routing: Literal[False] = False, output_dtype: Optional[DTypeName] = None,
                      timeout: Optional[float] = None, request_id: str = "") -> Tuple[Hidden, None]: ...
    @overload
    async def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None, *,
                      return_routing: Literal[True], output_dtype: Optional[DTypeName] = None,
                      timeout: Optional[float] = None, request_id: str = "") -> Tuple[Hidden, Routing]: ...
    @overload
    async def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None,
                      return_routing: bool = False, output_dtype: Optional[DTypeName] = None,
                      timeout: Optional[float] = None,
                      request_id: str = "") -> Tuple[Hidden, Optional[Routing]]: ...

    async def forward(self, layer: int, x: Hidden, dtype: Optional[DTypeName] = None,
                      return_routing: bool = False, output_dtype: Optional[DTypeName] = None,
                      timeout: Optional[float] = None,
                      request_id: str = "") -> Tuple[Hidden, Optional[Routing]]:
        """MoeClient.forward, awaited."""
        request = _request(layer, x, dtype, return_routing, output_dtype, request_id)
        await self._size_from_server()
        return _result(await self._call(self._rpc.forward, request, timeout), x, return_routing)

    @overload
    def forward_stream(self, layer: int, xs: Union[Iterable[Hidden], AsyncIterable[Hidden]], *,
                       dtype: Optional[DTypeName] = None, return_routing: Literal[False] = False,
                       output_dtype: Optional[DTypeName] = None, timeout: Optional[float] = None,
                       max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> AsyncIterator[Tuple[Hidden, None]]: ...
    @overload
    def forward_stream(self, layer: int, xs: Union[Iterable[Hidden], AsyncIterable[Hidden]], *,
                       dtype: Optional[DTypeName] = None, return_routing: Literal[True],
                       output_dtype: Optional[DTypeName] = None, timeout: Optional[float] = None,
                       max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> AsyncIterator[Tuple[Hidden, Routing]]: ...
    @overload
    def forward_stream(self, layer: int, xs: Union[Iterable[Hidden], AsyncIterable[Hidden]], *,
                       dtype: Optional[DTypeName] = None, return_routing: bool = False,
                       output_dtype: Optional[DTypeName] = None, timeout: Optional[float] = None,
                       max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
                       ) -> AsyncIterator[Tuple[Hidden, Optional[Routing]]]: ...

    def forward_stream(self, layer: int, xs: Union[Iterable[Hidden], AsyncIterable[Hidden]], *,
                       dtype: Optional[DTypeName] = None, return_routing: bool = False,
                       output_dtype: Optional[DTypeName] = None, timeout: Optional[float] = None,
                       max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
                       ) -> AsyncIterator[Tuple[Hidden, Optional[Routing]]]:
        """MoeClient.forward_stream as an async iterator (`async for y, routing in ...`)."""
        _check_window(max_in_flight)
        return self._stream(layer, xs, dtype, return_routing, output_dtype, timeout, max_in_flight)

    async def _stream(self, layer: int, xs: Union[Iterable[Hidden], AsyncIterable[Hidden]],
                      dtype: Optional[DTypeName], return_routing: bool, output_dtype: Optional[DTypeName],
                      timeout: Optional[float], max_in_flight: int) -> AsyncIterator[Tuple[Hidden, Optional[Routing]]]:
        await self._size_from_server()
        order: _InOrder[Hidden] = _InOrder(return_routing)
        window = asyncio.Semaphore(max_in_flight)
        call = self._rpc.forward_stream(timeout=timeout, metadata=self._metadata)

        async def write() -> None:
            items = _items(xs)
            index = 0
            try:
                while True:
                    try:
                        x = await items.__anext__()
                        request = _request(layer, x, dtype, return_routing, output_dtype, str(index))
                    except StopAsyncIteration:
                        return
                    except Exception as e:  # pylint: disable=broad-except  raised in order, below
                        order.failure = (index, e)
                        return
                    await window.acquire()
                    order.inputs[index] = x
                    order.sent = index + 1
                    await call.write(request)
                    index += 1
            finally:
                if not call.done():
                    await call.done_writing()

        writer = asyncio.ensure_future(write())
        try:
            while True:
                response = await call.read()
                if not isinstance(response, moe_pb2.ForwardResponse):  # grpc.aio.EOF
                    break
                window.release()
                order.add(response)
                for result in order.ready():
                    yield result
            await writer
            order.finish()
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        finally:
            call.cancel()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def info(self, timeout: Optional[float] = 10.0) -> moe_pb2.ModelInfo:
        """moe.v1.ModelInfo."""
        return await self._call(self._rpc.model_info, moe_pb2.GetModelInfoRequest(), timeout)

    async def load_balance(self, layer: int, timeout: Optional[float] = 10.0) -> moe_pb2.LoadBalanceReport:
        """MoeDiagnostics/GetLoadBalance (the admin token, when the gateway has one)."""
        return await self._call(self._rpc.load_balance, moe_pb2.GetLoadBalanceRequest(layer=layer), timeout)

    async def placement_advice(self, layer: int = -1, redundant_experts: int = 0,
                               timeout: Optional[float] = 30.0) -> moe_pb2.PlacementAdvice:
        """MoeDiagnostics/GetPlacementAdvice; layer < 0 sums every served layer's load."""
        request = moe_pb2.GetPlacementAdviceRequest(layer=layer, redundant_experts=redundant_experts)
        return await self._call(self._rpc.placement_advice, request, timeout)

    async def set_router_bias(self, layer: int, bias: Sequence[float], source: str = "moe_serve",
                              timeout: Optional[float] = 10.0) -> moe_pb2.SetRouterBiasResponse:
        """MoeDiagnostics/SetRouterBias; an empty `bias` restores the checkpoint's."""
        request = moe_pb2.SetRouterBiasRequest(layer=layer, bias=list(bias), source=source)
        return await self._call(self._rpc.set_router_bias, request, timeout)

    async def health(self, service: str = "", timeout: Optional[float] = 5.0) -> str:
        """MoeClient.health, awaited."""
        try:
            data = await self._rpc.health_check(_health_request(service), timeout=timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e) from None
        return _serving_status(data)

    async def close(self) -> None:
        for channel in [*self._replaced, self._channel, self._plain]:
            await channel.close()

    async def __aenter__(self) -> AsyncMoeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
