"""The Python client against the real service: moe-cluster (gateway + 2 ranks, real processes on
loopback) on a fresh k3-mini checkpoint; every batch is checked against moe-forward bit for bit,
ForwardStream results against Forward's, and the example of client/python/README.md runs.

Run by ctest (labels python, service) with MOE_BIN_DIR set; the client is the moe_serve package
from client/python. The ml_dtypes (bfloat16 numpy input) test skips without ml_dtypes, and fails
instead with MOE_REQUIRE_ML_DTYPES=1 (tests/client/python_typecheck_test.py runs
PythonClientServiceTest so, in its venv).
"""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

try:
    import ml_dtypes
except ImportError:  # not a Debian package: python_typecheck_test.py's venv has it (pinned)
    ml_dtypes = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))
import moe_serve  # noqa: E402  pylint: disable=wrong-import-position

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BIN = os.environ.get("MOE_BIN_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build", "bin"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterFixture(unittest.TestCase):
    """moe-cluster (gateway + 2 ranks) on a fresh k3-mini for a test class, and moe-forward as the
    in-process reference; holds no tests itself (kserve_service_test.py reuses it)."""
    # Extra moe-cluster flags and client arguments (the TLS subclass below).
    cluster_flags = []
    gateway_flags = []

    @classmethod
    def client_kwargs(cls):
        return {}

    @classmethod
    def target(cls):
        return f"127.0.0.1:{cls.port}"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.prepare()
        cls.ckpt = os.path.join(cls.tmp.name, "k3-mini")
        subprocess.run([os.path.join(BIN, "moe-ckpt"), "--preset", "k3-mini", "--out", cls.ckpt, "--quiet",
                        "--seed", "3"], check=True, stdout=subprocess.DEVNULL)
        cls.port = free_port()
        cls.log = open(os.path.join(cls.tmp.name, "cluster.log"), "w")
        cls.cluster = subprocess.Popen(
            [os.path.join(BIN, "moe-cluster"), "--checkpoint", cls.ckpt, "--ranks", "2", "--port", str(cls.port),
             "--control-port", str(free_port()), "--threads-per-rank", "1", *cls.cluster_flags, "--",
             "--threads", "1", *cls.gateway_flags],
            stdout=subprocess.PIPE, stderr=cls.log, text=True)
        line = cls.cluster.stdout.readline()  # blocks until the ready line (or exit)
        if "ready" not in line:
            cls.cluster.kill()
            raise RuntimeError(f"moe-cluster did not get ready: {line!r}\n" + open(cls.log.name).read())
        cls.client = moe_serve.MoeClient(cls.target(), **cls.client_kwargs())

    @classmethod
    def prepare(cls):
        pass

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.cluster.send_signal(signal.SIGTERM)
        code = cls.cluster.wait(timeout=30)
        cls.log.close()
        cls.tmp.cleanup()
        assert code == 0, f"moe-cluster exited with {code}"

    def moe_forward(self, layer, x):
        path_in = os.path.join(self.tmp.name, "x.npy")
        path_out = os.path.join(self.tmp.name, "y.npy")
        np.save(path_in, x)
        subprocess.run([os.path.join(BIN, "moe-forward"), "--checkpoint", self.ckpt, "--layer", str(layer),
                        "--input", path_in, "--output", path_out, "--threads", "1"],
                       check=True, stderr=subprocess.DEVNULL)
        return np.load(path_out)


class PythonClientServiceTest(ClusterFixture):
    def test_health_and_info(self):
        self.assertEqual(self.client.health(), "SERVING")
        info = self.client.info()
        self.assertEqual(list(info.layers), [1, 2])
        self.assertEqual(info.hidden_size, 640)
        self.assertEqual(len(info.ranks), 2)

    def test_round_trip_matches_in_process_layer(self):
        rng = np.random.default_rng(5)
        for layer, shape in [(1, (3, 640)), (2, (2, 5, 640)), (1, (1, 640))]:
            x = rng.standard_normal(shape).astype(np.float32)
            want = self.moe_forward(layer, x)
            for dtype in ("fp32", "bf16"):
                y, routing = self.client.forward(layer, x, dtype=dtype, return_routing=True, output_dtype="fp32")
                self.assertEqual(y.shape, x.shape)
                # A bf16 wire input is the same bf16-rounded input the layer uses: identical output.
                np.testing.assert_array_equal(y, want, err_msg=f"layer {layer} shape {shape} {dtype}")
                self.assertEqual(routing.top_k, 2)
                self.assertEqual(np.asarray(routing.expert_ids).size, 2 * int(np.prod(shape[:-1])))

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

    def test_stream_is_bit_identical_to_forward(self):
        rng = np.random.default_rng(11)
        xs = [rng.standard_normal(shape).astype(np.float32)
              for shape in [(3, 640), (1, 640), (2, 4, 640), (7, 640), (5, 640), (1, 2, 640), (2, 640)]]
        for layer, kwargs in ((1, {"return_routing": True, "output_dtype": "fp32"}), (2, {"dtype": "bf16"})):
            got = list(self.client.forward_stream(layer, xs, max_in_flight=3, **kwargs))
            want = [self.client.forward(layer, x, **kwargs) for x in xs]
            self.assert_same_results(got, want, kwargs.get("return_routing", False))
        np.testing.assert_array_equal(got[0][0], want[0][0])
        # A request that fails raises where its result would come.
        stream = self.client.forward_stream(1, [xs[0], np.ones((1, 64), np.float32), xs[1]])
        np.testing.assert_array_equal(next(stream)[0], self.client.forward(1, xs[0])[0])
        with self.assertRaises(moe_serve.MoeError) as ctx:
            next(stream)
        self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")
        self.assertIn("640", ctx.exception.details)
        with self.assertRaises(moe_serve.MoeError) as ctx:
            list(self.client.forward_stream(9, xs))
        self.assertEqual(ctx.exception.code.name, "NOT_FOUND")

        async def run():
            async with moe_serve.AsyncMoeClient(self.target(), **self.client_kwargs()) as client:
                return [r async for r in client.forward_stream(2, xs, return_routing=True, max_in_flight=4)]

        self.assert_same_results(asyncio.run(run()), [self.client.forward(2, x, return_routing=True) for x in xs],
                                 True)

    def test_async_diagnostics_match_the_blocking_client(self):
        # One gateway (of several, in a subclass): diagnostics are per gateway.
        gateway = f"127.0.0.1:{self.port}"

        async def run():
            async with moe_serve.AsyncMoeClient(gateway, **self.client_kwargs()) as client:
                calls = (await client.health(), await client.info(), await client.load_balance(1),
                         await client.placement_advice(-1, redundant_experts=2))
                with self.assertRaises(moe_serve.MoeError) as ctx:
                    await client.set_router_bias(1, [])
                return calls, ctx.exception

        with moe_serve.MoeClient(gateway, **self.client_kwargs()) as client:
            client.forward(1, np.ones((2, 640), np.float32))  # traffic to advise on
            (health, info, balance, advice), denied = asyncio.run(run())
            self.assertEqual(health, client.health())
            self.assertEqual(info.layers, client.info().layers)
            self.assertEqual((balance.layer, len(balance.expert_tokens)), (1, info.num_experts))
            sync_advice = client.placement_advice(-1, redundant_experts=2)
            self.assertEqual(len(advice.predicted_rank_load), len(sync_advice.predicted_rank_load))
            self.assertTrue(advice.placement)
            with self.assertRaises(moe_serve.MoeError) as ctx:
                client.set_router_bias(1, [])
        # Without --allow-bias-override: refused, the same way for both.
        self.assertEqual((denied.code.name, denied.details), (ctx.exception.code.name, ctx.exception.details))
        self.assertEqual(denied.code.name, "PERMISSION_DENIED")

    def test_bfloat16_array_input(self):
        if ml_dtypes is None:
            if os.environ.get("MOE_REQUIRE_ML_DTYPES") == "1":
                self.fail("MOE_REQUIRE_ML_DTYPES=1 but ml_dtypes is not importable")
            self.skipTest("ml_dtypes is not installed (tests/client/python_typecheck_test.py's venv has it)")
        x = np.random.default_rng(13).standard_normal((4, 640)).astype(ml_dtypes.bfloat16)
        as_float = x.astype(np.float32)
        y, routing = self.client.forward(1, x, output_dtype="fp32", return_routing=True)
        y32, routing32 = self.client.forward(1, as_float, dtype="fp32", output_dtype="fp32", return_routing=True)
        np.testing.assert_array_equal(y, y32)
        np.testing.assert_array_equal(routing.expert_ids, routing32.expert_ids)
        np.testing.assert_array_equal(y, self.moe_forward(1, as_float))
        bf16_out, _ = self.client.forward(1, x)  # bf16 on the wire both ways; numpy float32 out
        self.assertEqual(bf16_out.dtype, np.float32)
        np.testing.assert_array_equal(bf16_out, self.client.forward(1, as_float, dtype="bf16")[0])

    def test_package_readme_example_runs(self):
        if self.client_kwargs():
            self.skipTest("the example calls a plaintext gateway without a token")
        with open(os.path.join(SOURCE_DIR, "client", "python", "README.md"), encoding="utf-8") as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        self.assertTrue(blocks)
        script = "\n".join(blocks).replace("127.0.0.1:50051", self.target())
        env = dict(os.environ, PYTHONPATH=os.path.join(SOURCE_DIR, "client", "python"))
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        lines = run.stdout.splitlines()
        self.assertEqual(lines[0].split(" ", 1)[0], "(4,")
        self.assertEqual(lines[1:4], ["(1, 640)", "(2, 640)", "(3, 640)"])
        self.assertTrue(lines[4].startswith("NOT_FOUND "), lines[4])
        self.assertEqual(lines[5], "SERVING")
        self.assertEqual(lines[6:9], ["(1, 640) 2", "(2, 640) 2", "(3, 640) 2"])
        float(lines[9])

    def test_errors_carry_grpc_codes(self):
        with self.assertRaises(moe_serve.MoeError) as ctx:
            self.client.forward(9, np.ones((1, 640), np.float32))
        self.assertEqual(ctx.exception.code.name, "NOT_FOUND")
        with self.assertRaises(moe_serve.MoeError) as ctx:
            self.client.forward(1, np.ones((1, 64), np.float32))
        self.assertEqual(ctx.exception.code.name, "INVALID_ARGUMENT")


class PythonClientOverMutualTlsTest(PythonClientServiceTest):
    """The same tests through mTLS (certificates from scripts/make-certs.sh) and an API token;
    plus: without the client certificate or the token, nothing is answered."""

    @classmethod
    def prepare(cls):
        cls.certs = os.path.join(cls.tmp.name, "certs")
        subprocess.run(["bash", os.path.join(SOURCE_DIR, "scripts", "make-certs.sh"), cls.certs], check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(cls.tmp.name, "api-token"), "w") as f:
            f.write("python-test-token\n")
        cert = lambda name: os.path.join(cls.certs, name)  # noqa: E731
        cls.cluster_flags = ["--tls-cert", cert("gateway.pem"), "--tls-key", cert("gateway.key"),
                             "--tls-ca", cert("ca.pem"), "--rank-tls-cert", cert("rank.pem"),
                             "--rank-tls-key", cert("rank.key")]
        cls.gateway_flags = ["--api-token-file", os.path.join(cls.tmp.name, "api-token")]

    @classmethod
    def client_kwargs(cls, **overrides):
        kwargs = dict(tls_ca=os.path.join(cls.certs, "ca.pem"), tls_cert=os.path.join(cls.certs, "client.pem"),
                      tls_key=os.path.join(cls.certs, "client.key"), token="python-test-token")
        kwargs.update(overrides)
        return kwargs

    def test_refused_without_certificate_or_token(self):
        target = f"127.0.0.1:{self.port}"
        with moe_serve.MoeClient(target, **self.client_kwargs(token=None)) as client:
            self.assertEqual(client.health(), "SERVING")  # health needs no token
            with self.assertRaises(moe_serve.MoeError) as ctx:
                client.forward(1, np.ones((1, 640), np.float32))
            self.assertEqual(ctx.exception.code.name, "UNAUTHENTICATED")
        with moe_serve.MoeClient(target, **self.client_kwargs(tls_cert=None, tls_key=None)) as client:
            with self.assertRaises(moe_serve.MoeError) as ctx:
                client.health(timeout=3)
            self.assertEqual(ctx.exception.code.name, "UNAVAILABLE")  # the handshake fails
        with moe_serve.MoeClient(target) as client:  # plaintext
            with self.assertRaises(moe_serve.MoeError) as ctx:
                client.health(timeout=3)
            self.assertEqual(ctx.exception.code.name, "UNAVAILABLE")


class PythonClientOverTwoGatewaysTest(PythonClientOverMutualTlsTest):
    """The mTLS tests with two gateways over the ranks, the client given both (TLS verifies the
    first one's name); plus: a gateway killed costs no call (moe_serve retries UNAVAILABLE on the
    other) and comes back."""

    @classmethod
    def prepare(cls):
        super().prepare()
        cls.cluster_flags = cls.cluster_flags + ["--gateways", "2", "--restart-gateways"]

    @classmethod
    def target(cls):
        return f"127.0.0.1:{cls.port},127.0.0.1:{cls.port + 1}"

    def test_z_a_killed_gateway_costs_no_call(self):
        rng = np.random.default_rng(9)
        x = rng.standard_normal((4, 640)).astype(np.float32)
        want = self.moe_forward(1, x)
        gateway1 = subprocess.run(["pgrep", "-f", f"moe-gateway .*--port {self.port + 1} "],
                                  capture_output=True, text=True).stdout.split()
        self.assertEqual(len(gateway1), 1, gateway1)
        os.kill(int(gateway1[0]), signal.SIGKILL)
        for _ in range(40):  # through the kill and the restart (--restart-gateways)
            y, _ = self.client.forward(1, x, output_dtype="fp32")
            np.testing.assert_array_equal(y, want)
            time.sleep(0.05)
        deadline = time.time() + 30
        with moe_serve.MoeClient(f"127.0.0.1:{self.port + 1}", **self.client_kwargs()) as again:
            while time.time() < deadline:
                try:
                    if again.health() == "SERVING":
                        break
                except moe_serve.MoeError:
                    pass
                time.sleep(0.2)
            self.assertEqual(again.health(), "SERVING", "the restarted gateway serves again")
            y, _ = again.forward(1, x, output_dtype="fp32")
            np.testing.assert_array_equal(y, want)


if __name__ == "__main__":
    unittest.main()
