"""The moe_serve package (client/python) against a fake moe.v1 server started here (grpcio).

The fake answers output = 2 * input + layer in the requested output dtype, routing
{(layer + t) % 64, (layer + t + 17) % 64} with weights 0.75 / 0.25, INVALID_ARGUMENT for a
negative layer and NOT_FOUND for layer 404, and serves grpc.health.v1.Health/Check as raw bytes.
Its ForwardStream answers each request after a delay that makes later requests of every four
finish first (responses out of order, as the gateway's may come), failed ones as RequestError;
its MoeDiagnostics echo their requests.

Run: /usr/bin/python3 tests/client/python_client_test.py (the package from the source tree), or
with MOE_PY_INSTALLED=1 by a Python whose site-packages has it installed (python_package_test.py).
The ml_dtypes (bfloat16 numpy input) tests skip without ml_dtypes, and fail instead with
MOE_REQUIRE_ML_DTYPES=1 (python_typecheck_test.py, whose venv has it).
"""

import asyncio
import itertools
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from concurrent import futures

import grpc
import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
if os.environ.get("MOE_PY_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(REPO, "client", "python"))

import moe_serve  # noqa: E402  (needs the path above)
from moe_serve import moe_pb2, moe_pb2_grpc  # noqa: E402
from moe_serve import _tensors  # noqa: E402  pylint: disable=protected-access
from moe_serve.client import health_status  # noqa: E402

try:
    import torch
except ImportError:  # Debian's python3-torch is in install-deps; a host without it skips those
    torch = None
try:
    import ml_dtypes
except ImportError:  # not a Debian package: python_typecheck_test.py's venv has it (pinned)
    ml_dtypes = None
REQUIRE_ML_DTYPES = os.environ.get("MOE_REQUIRE_ML_DTYPES") == "1"
# ForwardStream's delay by request index % 4: the 4th of every four answers first.
STREAM_DELAYS = (0.06, 0.04, 0.02, 0.0)

HIDDEN = 8
MAX_TOKENS = 200000  # x HIDDEN fp32 = 6.4 MB


def wire(x, dtype):
    """The float32 value of x after a trip through `dtype`, computed independently of the client."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        # Round to nearest even on the upper 16 bits, via float64 arithmetic on the exact value.
        u = x.view(np.uint32).astype(np.uint64)
        lower = u & 0xFFFF
        upper = u >> 16
        round_up = (lower > 0x8000) | ((lower == 0x8000) & ((upper & 1) == 1))
        return ((upper + round_up) << 16).astype(np.uint32).view(np.float32)
    return x


class FakeStream:
    """One ForwardStream on the fake: request ids in the order answered; requests received and
    not yet answered (now, and the most at once); set when its RPC ends (cancelled included)."""

    def __init__(self):
        self.order = []
        self.outstanding = 0
        self.max_outstanding = 0
        self.ended = threading.Event()
        self.completed = False  # the handler ran to its end (not cancelled)


class FakeMoeService(moe_pb2_grpc.MoeServiceServicer):
    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()
        self.last_request = None
        # One FakeStream per ForwardStream, in the order they began.
        self.streams = []

    def compute(self, request):
        """(ForwardResponse, None), or (None, (grpc.StatusCode, message)) for a failed request."""
        if request.layer < 0:
            return None, (grpc.StatusCode.INVALID_ARGUMENT, f"layer must be >= 0, got {request.layer}")
        if request.layer == 404:
            return None, (grpc.StatusCode.NOT_FOUND, "layer 404 is not served (served: 1, 2, 3)")
        x = moe_serve.decode_tensor(request.hidden_states).astype(np.float32)
        if x.ndim not in (2, 3) or x.shape[-1] != HIDDEN:
            return None, (grpc.StatusCode.INVALID_ARGUMENT,
                          f"hidden_states: hidden size must be {HIDDEN}, got {x.shape[-1]}")
        y = (np.float32(2) * x + np.float32(request.layer)).astype(np.float32)
        out = request.output_dtype or request.hidden_states.dtype
        names = {moe_pb2.BF16: "bf16", moe_pb2.FP16: "fp16", moe_pb2.FP32: "fp32"}
        response = moe_pb2.ForwardResponse(output=moe_serve.encode_tensor(y, names[out]),
                                           request_id=request.request_id)
        tokens = x.size // HIDDEN
        if request.return_routing:
            response.routing.top_k = 2
            for t in range(tokens):
                response.routing.expert_ids.extend([(request.layer + t) % 64,
                                                    (request.layer + t + 17) % 64])
                response.routing.weights.extend([0.75, 0.25])
        response.timing.queue_us = 7
        response.timing.step_tokens = tokens
        return response, None

    def Forward(self, request, context):
        with self.lock:
            self.calls += 1
            self.last_request = request
        response, error = self.compute(request)
        if error is not None:
            context.abort(*error)
        return response

    def ForwardStream(self, request_iterator, context):
        stream = FakeStream()
        with self.lock:
            self.streams.append(stream)
        context.add_callback(stream.ended.set)
        answers = queue.Queue()

        def answer(index, request):
            # Layer 5: the first three at once, the rest after 5 s (a stream to stop early).
            time.sleep((0.0 if index < 3 else 5.0) if request.layer == 5 else STREAM_DELAYS[index % 4])
            response, error = self.compute(request)
            if error is not None:
                response = moe_pb2.ForwardResponse(request_id=request.request_id, error=moe_pb2.RequestError(
                    code=error[0].value[0], message=error[1]))
            answers.put(response)

        def read():
            workers = []
            try:
                for index, request in enumerate(request_iterator):
                    with self.lock:
                        stream.outstanding += 1
                        stream.max_outstanding = max(stream.max_outstanding, stream.outstanding)
                    workers.append(threading.Thread(target=answer, args=(index, request), daemon=True))
                    workers[-1].start()
            except grpc.RpcError:  # cancelled
                pass
            for worker in workers:
                worker.join()
            answers.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            try:
                response = answers.get(timeout=0.05)
            except queue.Empty:
                if not context.is_active():  # cancelled: leave the requests still running
                    return
                continue
            if response is None:
                break
            with self.lock:
                stream.outstanding -= 1
                stream.order.append(response.request_id)
            yield response
        # A cancel can also end the requests early (before the slow ones were read): then the
        # loop above ends without its timeout, and only the context tells a cancel from a close.
        stream.completed = context.is_active()

    def GetModelInfo(self, request, context):
        # A request limit large enough that its responses exceed gRPC's default 4 MiB.
        return moe_pb2.ModelInfo(family="kimi_k3", model_type="kimi_k3", layers=[1, 2, 3],
                                 hidden_size=HIDDEN, num_experts=64, top_k=2,
                                 max_request_tokens=MAX_TOKENS)


class FakeDiagnostics(moe_pb2_grpc.MoeDiagnosticsServicer):
    """Echoes each request in its response; SetRouterBias on layer 404 is PERMISSION_DENIED."""

    def GetLoadBalance(self, request, context):
        return moe_pb2.LoadBalanceReport(layer=request.layer, window_steps=3, window_tokens=12,
                                         expert_balancedness=0.5)

    def GetPlacementAdvice(self, request, context):
        return moe_pb2.PlacementAdvice(layer=request.layer, predicted_balancedness=0.75,
                                       placement=f"# redundant {request.redundant_experts}\n")

    def SetRouterBias(self, request, context):
        if request.layer == 404:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "bias overrides are off")
        return moe_pb2.SetRouterBiasResponse(override=moe_pb2.BiasOverride(
            layer=request.layer, source=f"{request.source}:{len(request.bias)}"))


class FakeHealth:
    """grpc.health.v1.Health/Check on raw bytes; the status is set by the test."""

    def __init__(self):
        self.status = 1  # SERVING

    def check(self, request_bytes, context):
        if request_bytes not in (b"", b"\x0a\x11moe.v1.MoeService"):
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return bytes([0x08, self.status])

    def handler(self):
        return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
            "Check": grpc.unary_unary_rpc_method_handler(self.check),
        })


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.service = FakeMoeService()
        cls.health = FakeHealth()
        cls.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                 options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        moe_pb2_grpc.add_MoeServiceServicer_to_server(cls.service, cls.server)
        moe_pb2_grpc.add_MoeDiagnosticsServicer_to_server(FakeDiagnostics(), cls.server)
        cls.server.add_generic_rpc_handlers((cls.health.handler(),))
        port = cls.server.add_insecure_port("127.0.0.1:0")
        cls.server.start()
        cls.target = f"127.0.0.1:{port}"
        cls.client = moe_serve.MoeClient(cls.target)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop(grace=None)

    def input(self, shape):
        # Non-zero, with more mantissa than bf16/fp16 keep.
        n = int(np.prod(shape))
        return (np.float32(0.3712593) * np.arange(1, n + 1, dtype=np.float32)
                - np.float32(2.1)).reshape(shape)

    def test_round_trip_every_dtype(self):
        x = self.input((3, HIDDEN))
        for dtype in ("fp32", "bf16", "fp16"):
            for out in (None, "fp32", "bf16", "fp16"):
                y, routing = self.client.forward(2, x, dtype=dtype, output_dtype=out)
                self.assertIsNone(routing)
                # numpy has no bf16: a bf16 output decodes to float32 (exactly).
                self.assertEqual(y.dtype, np.float16 if (out or dtype) == "fp16" else np.float32)
                self.assertEqual(y.shape, x.shape)
                want = wire(np.float32(2) * wire(x, dtype) + np.float32(2), out or dtype)
                np.testing.assert_array_equal(y, want, err_msg=f"{dtype} -> {out}")
        # The roundings are real on this input.
        self.assertFalse(np.array_equal(wire(x, "bf16"), x))
        self.assertFalse(np.array_equal(wire(x, "fp16"), x))

    def test_bf16_rounding_matches_ties_to_even(self):
        # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa (1) wins; 1 + 3 * 2^-8 rounds up.
        x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3.0e38, np.inf],
                     dtype=np.float32)
        bits = _tensors.bf16_bits(x)
        self.assertEqual(list(bits[:3]), [0x3F80, 0x3F82, 0xBF80])
        np.testing.assert_array_equal(_tensors.bf16_to_float32(bits), wire(x, "bf16"))
        self.assertTrue(np.isnan(_tensors.bf16_to_float32(_tensors.bf16_bits(np.array([np.nan], dtype=np.float32))))[0])

    def test_batch_shape_and_routing(self):
        x = self.input((2, 3, HIDDEN))
        y, routing = self.client.forward(3, x, return_routing=True)
        self.assertEqual(y.shape, (2, 3, HIDDEN))
        np.testing.assert_array_equal(y, np.float32(2) * x + np.float32(3))
        self.assertEqual(routing.top_k, 2)
        self.assertEqual(routing.expert_ids.shape, (6, 2))
        self.assertEqual(routing.expert_ids.dtype, np.int32)
        np.testing.assert_array_equal(routing.expert_ids[:, 0], 3 + np.arange(6))
        np.testing.assert_array_equal(routing.expert_ids[:, 1], 20 + np.arange(6))
        np.testing.assert_array_equal(routing.weights, np.tile([0.75, 0.25], (6, 1)))

    def test_float16_input_array(self):
        x = self.input((2, HIDDEN)).astype(np.float16)
        y, _ = self.client.forward(1, x)  # fp16 on the wire by default, fp16 back
        self.assertEqual(y.dtype, np.float16)
        np.testing.assert_array_equal(y, wire(np.float32(2) * x.astype(np.float32) + 1, "fp16"))
        # float64 (numpy's default) goes as fp32.
        x64 = self.input((2, HIDDEN)).astype(np.float64) * (1 + 1e-9)
        y, _ = self.client.forward(1, x64)
        np.testing.assert_array_equal(y, np.float32(2) * x64.astype(np.float32) + np.float32(1))

    @unittest.skipIf(torch is None, "torch is not installed (python3-torch)")
    def test_torch_tensors_in_and_out_bf16_included(self):
        x = torch.from_numpy(self.input((3, HIDDEN)))
        y, _ = self.client.forward(2, x)
        self.assertEqual(y.dtype, torch.float32)
        np.testing.assert_array_equal(y.numpy(), np.float32(2) * x.numpy() + np.float32(2))
        xb = x.to(torch.bfloat16)  # torch's own rounding; sent as its bits, unchanged
        y, _ = self.client.forward(2, xb)
        self.assertEqual(y.dtype, torch.bfloat16)
        want = wire(np.float32(2) * xb.to(torch.float32).numpy() + np.float32(2), "bf16")
        np.testing.assert_array_equal(y.to(torch.float32).numpy(), want)
        y, _ = self.client.forward(2, xb, output_dtype="fp32")
        self.assertEqual(y.dtype, torch.float32)
        np.testing.assert_array_equal(y.numpy(), np.float32(2) * xb.to(torch.float32).numpy() + np.float32(2))
        y, _ = self.client.forward(3, x.to(torch.float16))
        self.assertEqual(y.dtype, torch.float16)

    def test_message_limits_come_from_the_server(self):
        x = np.ones((150000, HIDDEN), np.float32) * np.float32(0.5)  # 4.8 MB each way
        with moe_serve.MoeClient(self.target) as client:
            y, _ = client.forward(1, x)
            np.testing.assert_array_equal(y, np.float32(2) * x + np.float32(1))
            self.assertEqual(client.max_message_bytes, moe_serve.message_limit(client.info()))
            self.assertGreater(client.max_message_bytes, 4 << 20)
        with moe_serve.MoeClient(self.target, max_message_bytes=4 << 20) as client:
            with self.assertRaises(moe_serve.MoeError) as raised:
                client.forward(1, x)
            self.assertEqual(raised.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)

    def test_async_client(self):
        async def run():
            async with moe_serve.AsyncMoeClient(self.target) as client:
                xs = [self.input((t, HIDDEN)) for t in (1, 3, 5)]
                results = await asyncio.gather(*(client.forward(2, x, return_routing=True) for x in xs))
                for x, (y, routing) in zip(xs, results):
                    np.testing.assert_array_equal(y, np.float32(2) * x + np.float32(2))
                    self.assertEqual(routing.expert_ids.shape, (x.shape[0], 2))
                self.assertEqual(list((await client.info()).layers), [1, 2, 3])
                with self.assertRaises(moe_serve.MoeError) as raised:
                    await client.forward(404, xs[0])
                self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        asyncio.run(run())

    def test_error_codes(self):
        x = self.input((1, HIDDEN))
        for layer, code, message in (
                (-1, grpc.StatusCode.INVALID_ARGUMENT, "layer must be >= 0, got -1"),
                (404, grpc.StatusCode.NOT_FOUND, "layer 404 is not served (served: 1, 2, 3)")):
            with self.assertRaises(moe_serve.MoeError) as raised:
                self.client.forward(layer, x)
            self.assertEqual(raised.exception.code, code)
            self.assertEqual(raised.exception.details, message)
        with self.assertRaises(moe_serve.MoeError) as raised:
            self.client.forward(1, self.input((1, 5)))
        self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(ValueError):
            self.client.forward(1, x, dtype="int8")

    def test_info_and_health(self):
        info = self.client.info()
        self.assertEqual(info.family, "kimi_k3")
        self.assertEqual(list(info.layers), [1, 2, 3])
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("moe.v1.MoeService"), "SERVING")
        with self.assertRaises(moe_serve.MoeError) as raised:
            self.client.health("no.such.Service")
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        self.health.status = 2
        try:
            self.assertEqual(self.client.health(), "NOT_SERVING")
        finally:
            self.health.status = 1

    def test_health_of_a_dead_server(self):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        server.stop(grace=None).wait()
        with moe_serve.MoeClient(f"127.0.0.1:{port}") as client:
            with self.assertRaises(moe_serve.MoeError) as raised:
                client.health(timeout=2.0)
            self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_health_response_decoding(self):
        decode = health_status
        self.assertEqual(decode(b""), 0)  # proto3 default: UNKNOWN
        self.assertEqual(decode(b"\x08\x01"), 1)
        self.assertEqual(decode(b"\x12\x02ab\x08\x02"), 2)  # unknown fields skipped

    def stream_inputs(self, n):
        return [self.input((1 + i % 5, HIDDEN)) * np.float32(1 + i) if i % 3 else
                self.input((2, 1 + i % 4, HIDDEN)) for i in range(n)]

    def streams(self):
        """The fake's ForwardStreams since the last call."""
        with self.service.lock:
            streams, self.service.streams = self.service.streams, []
        return streams

    def assert_same_results(self, got, want, routing):
        self.assertEqual(len(got), len(want))
        for i, ((y, r), (y1, r1)) in enumerate(zip(got, want)):
            self.assertEqual((y.dtype, y.shape), (y1.dtype, y1.shape), f"result {i}")
            np.testing.assert_array_equal(y, y1, err_msg=f"result {i}")
            if routing:
                np.testing.assert_array_equal(r.expert_ids, r1.expert_ids, err_msg=f"result {i}")
                np.testing.assert_array_equal(r.weights, r1.weights, err_msg=f"result {i}")
            else:
                self.assertIsNone(r)

    def test_stream_yields_in_order_what_forward_gives(self):
        xs = self.stream_inputs(12)
        orders = []
        for kwargs in ({}, {"return_routing": True}, {"dtype": "bf16", "output_dtype": "fp32"},
                       {"dtype": "fp16"}):
            self.streams()
            got = list(self.client.forward_stream(3, iter(xs), max_in_flight=8, **kwargs))
            want = [self.client.forward(3, x, **kwargs) for x in xs]
            self.assert_same_results(got, want, kwargs.get("return_routing", False))
            (stream,) = self.streams()
            self.assertEqual(sorted(stream.order, key=int), [str(i) for i in range(12)])
            orders.append(stream.order)
        # The fake answered out of order (by its delays), so the order is the client's doing.
        self.assertTrue(any(order != sorted(order, key=int) for order in orders), orders)
        # The routing overload: Routing itself, not Optional.
        _, routing = next(self.client.forward_stream(1, xs[:1], return_routing=True))
        self.assertEqual(routing.top_k, 2)

    def test_stream_keeps_at_most_max_in_flight_requests_unanswered(self):
        xs = self.stream_inputs(16)
        for window in (1, 3):
            self.streams()
            got = list(self.client.forward_stream(2, xs, max_in_flight=window))
            self.assertEqual(len(got), 16)
            self.assertLessEqual(self.streams()[0].max_outstanding, window)
        list(self.client.forward_stream(2, xs, max_in_flight=16))
        self.assertGreater(self.streams()[0].max_outstanding, 3)  # the bound above was the window's
        with self.assertRaisesRegex(ValueError, "max_in_flight must be at least 1, got 0"):
            self.client.forward_stream(2, xs, max_in_flight=0)

    def test_stream_failures_come_in_order(self):
        x = self.input((2, HIDDEN))
        stream = self.client.forward_stream(1, [x, x, self.input((1, 5)), x], max_in_flight=4)
        np.testing.assert_array_equal(next(stream)[0], np.float32(2) * x + np.float32(1))
        next(stream)
        with self.assertRaises(moe_serve.MoeError) as raised:
            next(stream)
        self.assertEqual(raised.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(raised.exception.details, "hidden_states: hidden size must be 8, got 5")
        with self.assertRaises(StopIteration):  # the stream is over after a failure
            next(stream)
        with self.assertRaises(moe_serve.MoeError) as raised:
            list(self.client.forward_stream(404, [x]))
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(raised.exception.details, "layer 404 is not served (served: 1, 2, 3)")

    def test_stream_input_errors_come_in_order(self):
        x = self.input((2, HIDDEN))
        for bad, error, message in (
                ([[0.5] * HIDDEN], TypeError, r"got list \(np\.asarray\(x, dtype=np\.float32\) makes one\)"),
                (np.ones((2, HIDDEN), np.int64), TypeError, "dtype int64"),
                (np.ones(HIDDEN, np.float32), ValueError, r"got shape \(8,\)")):
            stream = self.client.forward_stream(1, [x, x, bad, x])
            self.assertEqual(len([next(stream), next(stream)]), 2)
            with self.assertRaisesRegex(error, message):
                next(stream)

        def broken():
            yield x
            raise KeyError("the input generator broke")

        stream = self.client.forward_stream(1, broken())
        next(stream)
        with self.assertRaisesRegex(KeyError, "the input generator broke"):
            next(stream)

    def test_stream_stopped_early_is_cancelled(self):
        self.streams()
        taken = []

        def endless():
            for i in itertools.count():
                taken.append(i)
                yield self.input((1, HIDDEN))

        stream = self.client.forward_stream(5, endless(), max_in_flight=4)
        for _ in zip(range(3), stream):
            pass
        stream.close()
        # Cancelled: it ends before the requests in flight (5 s each on layer 5) could finish.
        (fake,) = self.streams()
        self.assertTrue(fake.ended.wait(4), "the stream's RPC did not end")
        self.assertFalse(fake.completed)
        self.assertLessEqual(len(taken), 3 + 4 + 1)

    def test_async_stream_and_diagnostics(self):
        xs = self.stream_inputs(10)

        async def agen():
            for x in xs:
                await asyncio.sleep(0)
                yield x

        async def run():
            async with moe_serve.AsyncMoeClient(self.target) as client:
                got = [r async for r in client.forward_stream(2, agen(), return_routing=True, max_in_flight=6)]
                got_list = [r async for r in client.forward_stream(2, xs)]
                stream = client.forward_stream(2, [xs[0], self.input((1, 5)), xs[0]])
                first = await stream.__anext__()
                with self.assertRaises(moe_serve.MoeError) as raised:
                    await stream.__anext__()
                diagnostics = (await client.health(), await client.health("moe.v1.MoeService"),
                               await client.load_balance(2), await client.placement_advice(redundant_experts=4),
                               await client.set_router_bias(3, [0.5, -0.5], source="test"))
                with self.assertRaises(moe_serve.MoeError) as denied:
                    await client.set_router_bias(404, [])
                with self.assertRaises(moe_serve.MoeError) as unknown:
                    await client.health("no.such.Service")
                # Stopped early: cancelled (layer 5's requests after the third take 5 s).
                endless = client.forward_stream(5, (self.input((1, HIDDEN)) for _ in itertools.count()),
                                                max_in_flight=4)
                for _ in range(3):
                    await endless.__anext__()
                await endless.aclose()
                fake = self.service.streams[-1]  # while the channel is open (closing it cancels)
                self.assertTrue(await asyncio.to_thread(fake.ended.wait, 4), "the stopped stream's RPC did not end")
                self.assertFalse(fake.completed)
                return got, got_list, first, raised.exception, diagnostics, denied.exception, unknown.exception

        self.streams()
        got, got_list, first, failed, diagnostics, denied, unknown = asyncio.run(run())
        orders = [stream.order for stream in self.streams()[:2]]
        self.assert_same_results(got, [self.client.forward(2, x, return_routing=True) for x in xs], True)
        self.assert_same_results(got_list, [self.client.forward(2, x) for x in xs], False)
        self.assertTrue(any(order != sorted(order, key=int) for order in orders), orders)
        np.testing.assert_array_equal(first[0], np.float32(2) * xs[0] + np.float32(2))
        self.assertEqual((failed.code, failed.details),
                         (grpc.StatusCode.INVALID_ARGUMENT, "hidden_states: hidden size must be 8, got 5"))
        self.assertEqual(diagnostics, (
            "SERVING", "SERVING", self.client.load_balance(2), self.client.placement_advice(redundant_experts=4),
            self.client.set_router_bias(3, [0.5, -0.5], source="test")))
        self.assertEqual(diagnostics[2].layer, 2)
        self.assertEqual(diagnostics[3].placement, "# redundant 4\n")
        self.assertEqual(diagnostics[4].override.source, "test:2")
        self.assertEqual(denied.code, grpc.StatusCode.PERMISSION_DENIED)
        self.assertEqual(unknown.code, grpc.StatusCode.NOT_FOUND)

    def test_inputs_of_the_wrong_kind_raise_before_sending(self):
        calls = self.service.calls
        for bad, error, message in (
                ([[0.5] * HIDDEN], TypeError, "hidden states must be a numpy array or a torch tensor; got list "
                                              r"\(np\.asarray\(x, dtype=np\.float32\) makes one\)"),
                ((0.5,) * HIDDEN, TypeError, "got tuple"),
                (7.0, TypeError, "got float"),
                (np.ones((2, HIDDEN), np.int32), TypeError,
                 r"must be floating point .*; got a numpy array of dtype int32 \(x\.astype\(np\.float32\)"),
                (np.ones((2, HIDDEN), np.bool_), TypeError, "dtype bool"),
                (np.ones((2, HIDDEN), np.complex64), TypeError, "dtype complex64"),
                (np.ones(HIDDEN, np.float32), ValueError,
                 r"must be \[tokens, hidden\] or \[batch, tokens, hidden\]; got shape \(8,\)"),
                (np.ones((1, 1, 2, HIDDEN), np.float32), ValueError, r"got shape \(1, 1, 2, 8\)")):
            with self.assertRaisesRegex(error, message):
                self.client.forward(1, bad)
            if error is TypeError:
                with self.assertRaisesRegex(error, message):
                    moe_serve.encode_tensor(bad)
        self.assertEqual(self.service.calls, calls)
        if torch is not None:
            with self.assertRaisesRegex(TypeError, r"torch tensor of dtype torch\.int64 \(x\.float\(\)"):
                self.client.forward(1, torch.ones(2, HIDDEN, dtype=torch.int64))

    def require_ml_dtypes(self):
        if ml_dtypes is None:
            if REQUIRE_ML_DTYPES:
                self.fail("MOE_REQUIRE_ML_DTYPES=1 but ml_dtypes is not importable")
            self.skipTest("ml_dtypes is not installed (python_typecheck_test.py's venv has it)")

    def test_bfloat16_arrays_go_as_their_bits(self):
        self.require_ml_dtypes()
        x = self.input((3, HIDDEN)).astype(ml_dtypes.bfloat16)
        y, _ = self.client.forward(2, x)
        sent = self.service.last_request.hidden_states
        self.assertEqual((sent.dtype, list(sent.shape)), (moe_pb2.BF16, [3, HIDDEN]))
        self.assertEqual(sent.data, x.view(np.uint16).astype("<u2").tobytes())
        self.assertEqual(y.dtype, np.float32)  # a bf16 output, decoded exactly
        as_float = x.astype(np.float32)
        np.testing.assert_array_equal(y, wire(np.float32(2) * as_float + np.float32(2), "bf16"))
        # The same values as float32 (fp32 on the wire): the same result.
        y32, _ = self.client.forward(2, as_float, output_dtype="bf16")
        self.assertEqual(self.service.last_request.hidden_states.dtype, moe_pb2.FP32)
        np.testing.assert_array_equal(y, y32)
        for out in ("fp32", "fp16"):
            a, _ = self.client.forward(2, x, output_dtype=out)
            b, _ = self.client.forward(2, as_float, output_dtype=out)
            self.assertEqual(a.dtype, b.dtype)
            np.testing.assert_array_equal(a, b)
        # Asked to go as fp32: the exact float32 values.
        self.client.forward(2, x, dtype="fp32")
        np.testing.assert_array_equal(
            np.frombuffer(self.service.last_request.hidden_states.data, "<f4").reshape(3, HIDDEN), as_float)
        got = list(self.client.forward_stream(2, [x, x[:1]]))
        np.testing.assert_array_equal(got[0][0], y)
        # Other ml_dtypes types are not taken.
        with self.assertRaisesRegex(TypeError, "dtype float8_e4m3fn"):
            self.client.forward(2, self.input((1, HIDDEN)).astype(ml_dtypes.float8_e4m3fn))

    def test_cli(self):
        with tempfile.TemporaryDirectory() as tmp:
            x = self.input((4, HIDDEN))
            np.save(os.path.join(tmp, "x.npy"), x)
            cli = [sys.executable, "-m", "moe_serve"]
            env = dict(os.environ)
            if os.environ.get("MOE_PY_INSTALLED") != "1":
                env["PYTHONPATH"] = os.path.join(REPO, "client", "python")
            run = subprocess.run(
                [*cli, "--target", self.target, "--layer", "2", "--input",
                 os.path.join(tmp, "x.npy"), "--output", os.path.join(tmp, "y.npy"),
                 "--routing-out", os.path.join(tmp, "ids.npy")],
                capture_output=True, text=True, check=False, env=env)
            self.assertEqual(run.returncode, 0, run.stderr)
            np.testing.assert_array_equal(np.load(os.path.join(tmp, "y.npy")),
                                          np.float32(2) * x + np.float32(2))
            self.assertEqual(np.load(os.path.join(tmp, "ids.npy")).shape, (4, 2))
            run = subprocess.run([*cli, "--target", self.target, "--health"],
                                 capture_output=True, text=True, check=False, env=env)
            self.assertEqual((run.returncode, run.stdout), (0, "SERVING\n"), run.stderr)
            run = subprocess.run(
                [*cli, "--target", self.target, "--layer", "-1", "--input",
                 os.path.join(tmp, "x.npy"), "--output", os.path.join(tmp, "y.npy")],
                capture_output=True, text=True, check=False, env=env)
            self.assertEqual(run.returncode, 1)
            self.assertIn("INVALID_ARGUMENT: layer must be >= 0, got -1", run.stderr)
            np.save(os.path.join(tmp, "ints.npy"), np.ones((2, HIDDEN), np.int64))
            run = subprocess.run(
                [*cli, "--target", self.target, "--layer", "1", "--input", os.path.join(tmp, "ints.npy"),
                 "--output", os.path.join(tmp, "y.npy")], capture_output=True, text=True, check=False, env=env)
            self.assertEqual(run.returncode, 1)
            self.assertIn("moe_serve: hidden states must be floating point", run.stderr)
            self.assertNotIn("Traceback", run.stderr)


if __name__ == "__main__":
    unittest.main()
