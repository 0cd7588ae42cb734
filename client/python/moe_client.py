"""A small Python client of the moe.v1 service, for Debian's python3-grpcio and numpy.

    client = MoeClient("localhost:50051")
    y, routing = client.forward(layer, x, dtype="bf16", return_routing=True)

The generated stubs (moe/v1/moe_pb2.py, moe_pb2_grpc.py) are found through the environment
variable MOE_PYTHON_STUBS, else in <repo>/build/python. There are deliberately no Python health
stubs (a generated `grpc/` package would shadow grpcio), so health() calls
/grpc.health.v1.Health/Check with hand-encoded bytes.

CLI: /usr/bin/python3 client/python/moe_client.py --target HOST:PORT --layer L \
         --input x.npy --output y.npy [--dtype bf16|fp16|fp32] [--routing-out ids.npy]
     /usr/bin/python3 client/python/moe_client.py --target HOST:PORT --health | --info
"""

import argparse
import os
import sys

import grpc
import numpy as np


def _import_stubs():
    stubs = os.environ.get("MOE_PYTHON_STUBS") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "python")
    stubs = os.path.abspath(stubs)
    if not os.path.isfile(os.path.join(stubs, "moe", "v1", "moe_pb2.py")):
        raise ImportError(
            f"moe.v1 Python stubs not found in {stubs}: build the project (target "
            "moe_proto_python) or set MOE_PYTHON_STUBS to the directory holding moe/v1/")
    if stubs not in sys.path:
        sys.path.insert(0, stubs)
    from moe.v1 import moe_pb2, moe_pb2_grpc  # pylint: disable=import-outside-toplevel
    return moe_pb2, moe_pb2_grpc


moe_pb2, moe_pb2_grpc = _import_stubs()

_DTYPES = {"bf16": moe_pb2.BF16, "fp16": moe_pb2.FP16, "fp32": moe_pb2.FP32}
# grpc.health.v1.HealthCheckResponse.ServingStatus
_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
_MAX_MESSAGE_BYTES = 1 << 30  # K3 batches are large


class MoeError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _bf16_bits(x):
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def _bf16_to_float32(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _wire_dtype(name):
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def encode_tensor(x, dtype="fp32"):
    """numpy array -> moe.v1.Tensor (little-endian raw bytes)."""
    wire_dtype = _wire_dtype(dtype)
    x = np.asarray(x)
    if dtype == "fp32":
        data = np.ascontiguousarray(x, dtype="<f4").tobytes()
    elif dtype == "fp16":
        data = np.ascontiguousarray(x, dtype="<f2").tobytes()
    else:
        data = _bf16_bits(x.astype(np.float32)).astype("<u2").tobytes()
    return moe_pb2.Tensor(dtype=wire_dtype, shape=list(x.shape), data=data)


def decode_tensor(tensor):
    """moe.v1.Tensor -> float32 numpy array of its shape (exact for every dtype)."""
    shape = tuple(tensor.shape)
    if tensor.dtype == moe_pb2.FP32:
        flat = np.frombuffer(tensor.data, dtype="<f4")
    elif tensor.dtype == moe_pb2.FP16:
        flat = np.frombuffer(tensor.data, dtype="<f2").astype(np.float32)
    elif tensor.dtype == moe_pb2.BF16:
        flat = _bf16_to_float32(np.frombuffer(tensor.data, dtype="<u2"))
    else:
        raise ValueError(f"unsupported tensor dtype {tensor.dtype}")
    if flat.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"tensor of shape {shape} carries {flat.size} values")
    return flat.astype(np.float32, copy=False).reshape(shape)


class Routing:
    """Router choices: expert_ids int32 and weights float32, both [tokens, top_k]."""

    def __init__(self, top_k, expert_ids, weights):
        self.top_k = top_k
        self.expert_ids = expert_ids
        self.weights = weights

    def __repr__(self):
        return f"Routing(top_k={self.top_k}, tokens={self.expert_ids.shape[0]})"


def _decode_health_response(data):
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


def _read_varint(data, i):
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


def _encode_health_request(service):
    """grpc.health.v1.HealthCheckRequest{service}: empty for the server as a whole."""
    if not service:
        return b""
    raw = service.encode()
    out, n = bytearray([0x0A]), len(raw)
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + raw


class MoeClient:
    """One channel to a moe.v1 server; safe to share between threads."""

    def __init__(self, target, max_message_bytes=_MAX_MESSAGE_BYTES, tls=False, tls_ca=None,
                 tls_cert=None, tls_key=None, tls_server_name=None, token=None):
        """TLS when `tls` or any tls_* file is given: tls_ca (PEM path) is the trust for the
        gateway's certificate (else the system's roots); tls_cert + tls_key, a client certificate
        for a gateway that requires mTLS. `token` goes with every call as
        `authorization: Bearer` (the gateway's --api-token-file or --admin-token-file)."""
        self.target = target
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if tls or tls_ca or tls_cert:
            def read(path):
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()
            credentials = grpc.ssl_channel_credentials(
                root_certificates=read(tls_ca), private_key=read(tls_key),
                certificate_chain=read(tls_cert))
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        # Per call, not as call credentials: gRPC sends those only over TLS, and a token on a
        # plaintext channel to a trusted network is a deployment's choice.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = moe_pb2_grpc.MoeServiceStub(self._channel)
        # No serializers: raw bytes in and out.
        self._health_check = self._channel.unary_unary("/grpc.health.v1.Health/Check")

    def forward(self, layer, x, dtype="fp32", return_routing=False, output_dtype=None,
                timeout=None, request_id=""):
        """Runs `layer` on x ([T, H] or [B, T, H]). Returns (float32 output of x's shape,
        Routing or None). Raises MoeError with the server's code and message."""
        request = moe_pb2.ForwardRequest(
            layer=layer, hidden_states=encode_tensor(x, dtype), return_routing=return_routing,
            output_dtype=_wire_dtype(output_dtype) if output_dtype else moe_pb2.DTYPE_UNSPECIFIED,
            request_id=request_id)
        try:
            response = self._stub.Forward(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise MoeError(e.code(), e.details()) from None
        y = decode_tensor(response.output)
        routing = None
        if return_routing:
            k = response.routing.top_k
            ids = np.array(response.routing.expert_ids, dtype=np.int32)
            weights = np.array(response.routing.weights, dtype=np.float32)
            tokens = ids.size // k if k > 0 else 0
            routing = Routing(k, ids.reshape(tokens, k), weights.reshape(tokens, k))
        return y, routing

    def info(self, timeout=10.0):
        """moe.v1.ModelInfo."""
        try:
            return self._stub.GetModelInfo(moe_pb2.GetModelInfoRequest(), timeout=timeout,
                                           metadata=self._metadata)
        except grpc.RpcError as e:
            raise MoeError(e.code(), e.details()) from None

    def health(self, service="", timeout=5.0):
        """The health status name: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN".
        Raises MoeError when the check fails (server down: UNAVAILABLE)."""
        try:
            data = self._health_check(_encode_health_request(service), timeout=timeout)
        except grpc.RpcError as e:
            raise MoeError(e.code(), e.details()) from None
        status = _decode_health_response(data)
        return _SERVING_STATUS.get(status, f"UNKNOWN({status})")

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description="moe.v1 client: one forward, health or info")
    parser.add_argument("--target", required=True, help="HOST:PORT")
    parser.add_argument("--layer", type=int)
    parser.add_argument("--input", help="input .npy, float32/float16, [T, H] or [B, T, H]")
    parser.add_argument("--output", help="output .npy (float32)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    parser.add_argument("--routing-out", help="expert ids [tokens, top_k] (int32 .npy)")
    parser.add_argument("--routing-weights-out", help="routing weights [tokens, top_k] (.npy)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--health", action="store_true", help="print the health status")
    parser.add_argument("--info", action="store_true", help="print the model info")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's roots")
    parser.add_argument("--tls-ca", help="PEM CA bundle the gateway's certificate chains to")
    parser.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name the gateway's certificate must carry")
    parser.add_argument("--token-file", help="send its token as `authorization: Bearer`")
    args = parser.parse_args(argv)
    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    with MoeClient(args.target, tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                   tls_key=args.tls_key, tls_server_name=args.tls_server_name, token=token) as client:
        try:
            if args.health:
                status = client.health()
                print(status)
                return 0 if status == "SERVING" else 1
            if args.info:
                print(client.info(), end="")
                return 0
            if args.layer is None or not args.input or not args.output:
                parser.error("forward needs --layer, --input and --output")
            x = np.load(args.input)
            want_routing = bool(args.routing_out or args.routing_weights_out)
            y, routing = client.forward(args.layer, x, dtype=args.dtype,
                                        return_routing=want_routing, timeout=args.timeout)
        except MoeError as e:
            print(f"moe_client.py: {e}", file=sys.stderr)
            return 1
    np.save(args.output, y.astype(np.float32))
    if args.routing_out:
        np.save(args.routing_out, routing.expert_ids)
    if args.routing_weights_out:
        np.save(args.routing_weights_out, routing.weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
