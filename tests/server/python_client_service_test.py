"""The Python client against the real service: moe-cluster (gateway + 2 ranks, real processes on
loopback) on a fresh k3-mini checkpoint; every batch is checked against moe-forward bit for bit.

Run by ctest (labels python, service) with MOE_BIN_DIR set; the client is the moe_serve package
from client/python.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

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
