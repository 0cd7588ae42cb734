"""The moe_serve package (client/python) against a fake moe.v1 server started here (grpcio).

The fake answers output = 2 * input + layer in the requested output dtype, routing
{(layer + t) % 64, (layer + t + 17) % 64} with weights 0.75 / 0.25, INVALID_ARGUMENT for a
negative layer and NOT_FOUND for layer 404, and serves grpc.health.v1.Health/Check as raw bytes.

Run: /usr/bin/python3 tests/client/python_client_test.py (the package from the source tree), or
with MOE_PY_INSTALLED=1 by a Python whose site-packages has it installed (python_package_test.py).
"""

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
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


class FakeMoeService(moe_pb2_grpc.MoeServiceServicer):
    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def Forward(self, request, context):
        with self.lock:
            self.calls += 1
        if request.layer < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"layer must be >= 0, got {request.layer}")
        if request.layer == 404:
            context.abort(grpc.StatusCode.NOT_FOUND, "layer 404 is not served (served: 1, 2, 3)")
        x = moe_serve.decode_tensor(request.hidden_states).astype(np.float32)
        if x.ndim not in (2, 3) or x.shape[-1] != HIDDEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
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
        return response

    def GetModelInfo(self, request, context):
        # A request limit large enough that its responses exceed gRPC's default 4 MiB.
        return moe_pb2.ModelInfo(family="kimi_k3", model_type="kimi_k3", layers=[1, 2, 3],
                                 hidden_size=HIDDEN, num_experts=64, top_k=2,
                                 max_request_tokens=MAX_TOKENS)


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


if __name__ == "__main__":
    unittest.main()
