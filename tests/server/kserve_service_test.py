"""The Open Inference Protocol (KServe v2) on the gateway, against real processes on loopback
(moe-cluster: gateway + 2 ranks, k3-mini), with two clients:

- one generated from proto/inference/grpc_service.proto (build/python/inference, Debian's grpcio);
- tritonclient[grpc] from PyPI, pinned, in a venv this test makes under the build tree. It runs
  as a subprocess (kserve_tritonclient_check.py): its stubs and ours both define inference.*,
  which one protobuf descriptor pool refuses. It also checks that our proto and tritonclient's
  agree field for field.

Every output is compared bit for bit with moe.v1 Forward on the same gateway (which
python_client_service_test.py compares with moe-forward, the in-process layer). Run by ctest
(labels python, service) with MOE_BIN_DIR, MOE_PYTHON_STUBS and MOE_KSERVE_VENV set.
"""

import base64
import json
import os
import subprocess
import sys
import unittest
import urllib.request

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_client_service_test import SOURCE_DIR, ClusterFixture, free_port  # noqa: E402

sys.path.insert(0, os.environ.get("MOE_PYTHON_STUBS", os.path.join(SOURCE_DIR, "build", "python")))
from inference import grpc_service_pb2 as pb  # noqa: E402
from inference import grpc_service_pb2_grpc as pb_grpc  # noqa: E402

HIDDEN = 640
TOP_K = 2
MAX_TOKENS = 300

# tritonclient and what it needs, pinned (shared with scripts/perf-analyzer.sh).
REQUIREMENTS = os.path.join(SOURCE_DIR, "scripts", "kserve-requirements.txt")


def ensure_triton_venv(path):
    """The venv with REQUIREMENTS, made once per build tree (needs PyPI the first time)."""
    stamp = os.path.join(path, "moe-requirements.txt")
    with open(REQUIREMENTS) as f:
        want = f.read()
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read() == want:
                return os.path.join(path, "bin", "python")
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--clear", path], check=True)
    pip = subprocess.run([os.path.join(path, "bin", "pip"), "install", "--quiet", "--disable-pip-version-check",
                          "-r", REQUIREMENTS], capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        raise RuntimeError("could not install tritonclient from PyPI into " + path + ":\n" + pip.stderr[-3000:])
    with open(stamp, "w") as f:
        f.write(want)
    return os.path.join(path, "bin", "python")


def perf_analyzer_env(python):
    """(perf_analyzer's path, its environment) in the venv of `python`."""
    venv = os.path.dirname(os.path.dirname(python))
    lib = subprocess.run([python, "-c", "import nvidia.cuda_runtime, os; "
                          "print(os.path.join(nvidia.cuda_runtime.__path__[0], 'lib'))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, LD_LIBRARY_PATH=lib)
    return os.path.join(venv, "bin", "perf_analyzer"), env


def run_perf_analyzer(python, work_dir, seed, protocol, url, extra=()):
    """perf_analyzer -i `protocol` on moe-layer-1: a short run at concurrency 2 on bf16 inputs it
    reads from a JSON file (its own random bytes would hold NaNs, which are refused). The run
    shows compatibility, not a figure: on a loaded host its windows may differ by more than the
    default 10 % stability, hence -s 1000."""
    binary, env = perf_analyzer_env(python)
    rng = np.random.default_rng(seed)
    data = [{"hidden_states": {"b64": base64.b64encode(bf16_bytes(rng.standard_normal((8, HIDDEN)))).decode(),
                               "shape": [8, HIDDEN]}} for _ in range(4)]
    path = os.path.join(work_dir, f"perf-input-{protocol}.json")
    with open(path, "w") as f:
        json.dump({"data": data}, f)
    return subprocess.run([binary, "-m", "moe-layer-1", "-i", protocol, "-u", url, *extra, "--input-data", path,
                           "--shape", f"hidden_states:8,{HIDDEN}", "--concurrency-range", "2",
                           "--measurement-interval", "1000", "--max-trials", "3", "-s", "1000"],
                          capture_output=True, text=True, timeout=240, env=env)


def bf16_round(x):
    """x rounded to the nearest bf16 (even on ties), as float32."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def bf16_bytes(x):
    return (bf16_round(x).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def bf16_from_bytes(data, shape):
    bits = np.frombuffer(data, np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


def metric_value(text, name, labels):
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class KServeServiceTest(ClusterFixture):
    @classmethod
    def prepare(cls):
        cls.metrics_port = free_port()
        cls.gateway_flags = ["--max-request-tokens", str(MAX_TOKENS), "--metrics-port", str(cls.metrics_port)]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.channel = grpc.insecure_channel(f"127.0.0.1:{cls.port}",
                                            options=[("grpc.max_receive_message_length", 64 << 20),
                                                     ("grpc.max_send_message_length", 64 << 20)])
        cls.kserve = pb_grpc.GRPCInferenceServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        super().tearDownClass()

    def forward(self, layer, x, dtype):
        """moe.v1 Forward: output in `dtype` (as float32 values) and the routing."""
        y, routing = self.client.forward(layer, x, dtype=dtype, return_routing=True, output_dtype=dtype)
        return np.asarray(y, np.float32), routing

    def infer(self, layer, x, datatype, outputs=(), typed=False, parameters=None):
        request = pb.ModelInferRequest(model_name=f"moe-layer-{layer}", id="req-7")
        tensor = request.inputs.add(name="hidden_states", datatype=datatype, shape=list(x.shape))
        if typed:
            tensor.contents.fp32_contents.extend(x.astype(np.float32).ravel().tolist())
        elif datatype == "FP32":
            request.raw_input_contents.append(x.astype("<f4").tobytes())
        elif datatype == "FP16":
            request.raw_input_contents.append(x.astype("<f2").tobytes())
        else:
            request.raw_input_contents.append(bf16_bytes(x))
        for name in outputs:
            request.outputs.add(name=name)
        for key, value in (parameters or {}).items():
            request.parameters[key].string_param = value
        return self.kserve.ModelInfer(request, timeout=60)

    @staticmethod
    def decode(response, index):
        out = response.outputs[index]
        raw = response.raw_output_contents[index]
        shape = tuple(out.shape)
        if out.datatype == "FP32":
            return np.frombuffer(raw, "<f4").reshape(shape)
        if out.datatype == "FP16":
            return np.frombuffer(raw, "<f2").astype(np.float32).reshape(shape)
        if out.datatype == "BF16":
            return bf16_from_bytes(raw, shape)
        if out.datatype == "INT32":
            return np.frombuffer(raw, "<i4").reshape(shape)
        raise AssertionError(out.datatype)

    def assert_code(self, code, fn):
        with self.assertRaises(grpc.RpcError) as ctx:
            fn()
        self.assertEqual(ctx.exception.code(), code, ctx.exception.details())
        return ctx.exception.details()

    def test_health_and_metadata(self):
        self.assertTrue(self.kserve.ServerLive(pb.ServerLiveRequest()).live)
        self.assertTrue(self.kserve.ServerReady(pb.ServerReadyRequest()).ready)
        meta = self.kserve.ServerMetadata(pb.ServerMetadataRequest())
        self.assertEqual(meta.name, "moe-gateway")
        self.assertTrue(meta.version)
        for name, version, ready in [("moe-layer-1", "", True), ("moe-layer-2", "1", True), ("moe-layer-2", "2", False),
                                     ("moe-layer-9", "", False), ("moe-layer-", "", False), ("bogus", "", False),
                                     ("moe-layer-+1", "", False)]:
            self.assertEqual(self.kserve.ModelReady(pb.ModelReadyRequest(name=name, version=version)).ready, ready,
                             f"{name} {version}")
        model = self.kserve.ModelMetadata(pb.ModelMetadataRequest(name="moe-layer-2"))
        self.assertEqual(model.name, "moe-layer-2")
        self.assertEqual(list(model.versions), ["1"])
        self.assertEqual([(t.name, t.datatype, list(t.shape)) for t in model.inputs],
                         [("hidden_states", "BF16", [-1, HIDDEN])])
        self.assertEqual([(t.name, t.datatype, list(t.shape)) for t in model.outputs],
                         [("output", "BF16", [-1, HIDDEN]), ("expert_ids", "INT32", [-1, TOP_K]),
                          ("routing_weights", "FP32", [-1, TOP_K])])
        self.assert_code(grpc.StatusCode.NOT_FOUND,
                         lambda: self.kserve.ModelMetadata(pb.ModelMetadataRequest(name="moe-layer-9")))
        self.assert_code(grpc.StatusCode.NOT_FOUND,
                         lambda: self.kserve.ModelMetadata(pb.ModelMetadataRequest(name="moe-layer-1", version="3")))

    def test_outputs_are_bit_identical_to_forward(self):
        rng = np.random.default_rng(11)
        for layer, shape in [(1, (1, HIDDEN)), (2, (3, HIDDEN)), (1, (257, HIDDEN)), (2, (2, 3, HIDDEN))]:
            x = rng.standard_normal(shape).astype(np.float32)
            for datatype, dtype in [("FP32", "fp32"), ("FP16", "fp16"), ("BF16", "bf16")]:
                want, routing = self.forward(layer, x, dtype)
                response = self.infer(layer, x, datatype, outputs=("output", "expert_ids", "routing_weights"))
                what = f"layer {layer} shape {shape} {datatype}"
                self.assertEqual(response.model_name, f"moe-layer-{layer}")
                self.assertEqual(response.model_version, "1")
                self.assertEqual(response.id, "req-7")
                self.assertEqual([o.name for o in response.outputs], ["output", "expert_ids", "routing_weights"])
                self.assertEqual(response.outputs[0].datatype, datatype)
                np.testing.assert_array_equal(self.decode(response, 0), want.reshape(shape), err_msg=what)
                routing_shape = shape[:-1] + (TOP_K,)
                np.testing.assert_array_equal(self.decode(response, 1),
                                              np.asarray(routing.expert_ids).reshape(routing_shape), err_msg=what)
                np.testing.assert_array_equal(self.decode(response, 2),
                                              np.asarray(routing.weights, np.float32).reshape(routing_shape),
                                              err_msg=what)
                self.assertGreater(response.parameters["step_tokens"].int64_param, 0)
        # The typed fp32_contents field, an output dtype other than the input's, only the routing.
        x = rng.standard_normal((5, HIDDEN)).astype(np.float32)
        want, routing = self.forward(1, x, "fp32")
        np.testing.assert_array_equal(self.decode(self.infer(1, x, "FP32", typed=True), 0), want)
        want_bf16, _ = self.client.forward(1, x, dtype="fp32", output_dtype="bf16")
        response = self.infer(1, x, "FP32", parameters={"output_datatype": "BF16"})
        self.assertEqual(response.outputs[0].datatype, "BF16")
        np.testing.assert_array_equal(self.decode(response, 0), want_bf16)
        response = self.infer(1, x, "FP32", outputs=("expert_ids",))
        self.assertEqual([o.name for o in response.outputs], ["expert_ids"])
        np.testing.assert_array_equal(self.decode(response, 0).ravel(), np.asarray(routing.expert_ids).ravel())

    def test_bad_requests_get_the_codes_forward_gives(self):
        x = np.random.default_rng(2).standard_normal((2, HIDDEN)).astype(np.float32)
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        self.assert_code(grpc.StatusCode.NOT_FOUND, lambda: self.infer(9, x, "FP32"))
        request = pb.ModelInferRequest(model_name="moe-layer-1", model_version="2")
        self.assert_code(grpc.StatusCode.NOT_FOUND, lambda: self.kserve.ModelInfer(request))
        self.assert_code(invalid, lambda: self.infer(1, x, "INT32"))
        self.assert_code(invalid, lambda: self.infer(1, x, "FP32", outputs=("logits",)))
        self.assert_code(invalid, lambda: self.infer(1, x, "FP32", outputs=("output", "output")))
        self.assert_code(invalid, lambda: self.infer(1, x, "FP32", parameters={"output_datatype": "INT8"}))
        self.assert_code(invalid, lambda: self.infer(1, x[:, :64], "FP32"))  # wrong hidden size
        bad = x.copy()
        bad[1, 3] = np.nan
        self.assertIn("contains NaN (token 1", self.assert_code(invalid, lambda: self.infer(1, bad, "FP32")))
        self.assert_code(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         lambda: self.infer(1, np.ones((MAX_TOKENS + 1, HIDDEN), np.float32), "FP32"))
        # Bytes that do not match the shape; BF16 in the typed field; no input; two inputs.
        request = pb.ModelInferRequest(model_name="moe-layer-1")
        request.inputs.add(name="hidden_states", datatype="FP32", shape=[2, HIDDEN])
        request.raw_input_contents.append(b"\0" * 12)
        self.assert_code(invalid, lambda: self.kserve.ModelInfer(request))
        request = pb.ModelInferRequest(model_name="moe-layer-1")
        request.inputs.add(name="hidden_states", datatype="BF16", shape=[1, HIDDEN]).contents.fp32_contents.extend(
            [1.0] * HIDDEN)
        self.assertIn("raw_input_contents", self.assert_code(invalid, lambda: self.kserve.ModelInfer(request)))
        self.assert_code(invalid, lambda: self.kserve.ModelInfer(pb.ModelInferRequest(model_name="moe-layer-1")))
        request = pb.ModelInferRequest(model_name="moe-layer-1")
        for name in ("hidden_states", "extra"):
            request.inputs.add(name=name, datatype="FP32", shape=[1, HIDDEN])
            request.raw_input_contents.append(np.ones(HIDDEN, "<f4").tobytes())
        self.assert_code(invalid, lambda: self.kserve.ModelInfer(request))

    def request_counts(self, layer):
        """moe_requests_total of `layer` by code, from the gateway's /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        codes = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE")
        return {code: metric_value(text, "moe_requests_total", {"layer": str(layer), "code": code}) for code in codes}

    def test_requests_count_in_the_forward_metrics(self):
        before = self.request_counts(2)
        x = np.random.default_rng(3).standard_normal((1, HIDDEN)).astype(np.float32)
        for _ in range(3):
            self.infer(2, x, "FP32")
        self.assert_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: self.infer(2, x[:, :8], "FP32"))
        after = self.request_counts(2)
        self.assertEqual(after["OK"] - before["OK"], 3)
        self.assertEqual(after["INVALID_ARGUMENT"] - before["INVALID_ARGUMENT"], 1)

    def test_tritonclient(self):
        """tritonclient[grpc] (PyPI) against the gateway; its outputs against Forward's."""
        python = ensure_triton_venv(os.environ.get("MOE_KSERVE_VENV",
                                                   os.path.join(SOURCE_DIR, "build", "kserve-venv")))
        rng = np.random.default_rng(23)
        work = os.path.join(self.tmp.name, "triton")
        os.makedirs(work, exist_ok=True)
        cases = []
        for i, (layer, tokens, datatype) in enumerate([(1, 1, "FP32"), (2, 3, "FP16"), (1, 257, "BF16"),
                                                        (2, 4, "FP32")]):
            x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
            if datatype == "BF16":
                x = bf16_round(x)  # tritonclient truncates float32 to bf16: exact on bf16 values
            np.save(os.path.join(work, f"x{i}.npy"), x)
            cases.append({"index": i, "model": f"moe-layer-{layer}", "datatype": datatype})
        with open(os.path.join(work, "cases.json"), "w") as f:
            json.dump(cases, f)
        check = subprocess.run([python, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "kserve_tritonclient_check.py"),
                                f"127.0.0.1:{self.port}", work, os.path.join(SOURCE_DIR, "proto")],
                               capture_output=True, text=True, timeout=300)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        with open(os.path.join(work, "report.json")) as f:
            report = json.load(f)
        self.assertEqual(report["proto_fields_compared"], report["proto_fields_ours"])
        self.assertGreater(report["proto_fields_ours"], 60)
        self.assertTrue(report["live"] and report["ready"] and report["model_ready"])
        self.assertFalse(report["unknown_model_ready"])
        self.assertEqual(report["unknown_model_infer_status"], "StatusCode.NOT_FOUND")
        # Triton's extensions.
        self.assertEqual(len(report["stream_errors"]), 1, report["stream_errors"])
        self.assertIn("layer 99 is not served", report["stream_errors"][0])
        self.assertEqual(report["config"], {
            "name": "moe-layer-1", "max_batch_size": 0,
            "inputs": [["hidden_states", "TYPE_BF16", ["-1", str(HIDDEN)]]],
            "outputs": ["output", "expert_ids", "routing_weights"]})
        self.assertEqual(report["index"], [["moe-layer-1", "1", "READY"], ["moe-layer-2", "1", "READY"]])
        for extension in ("model_configuration", "statistics", "model_repository"):
            self.assertIn(extension, report["extensions"])
        # Statistics count what this check sent (unary and streamed, 2 requests per case) on top of
        # what the other tests sent before; times add up: queue + compute = success.
        for model in ("moe-layer-1", "moe-layer-2"):
            stats = report["stats"][model]
            sent = 2 * sum(1 for c in cases if c["model"] == model)
            self.assertGreaterEqual(stats["inference_count"], sent, stats)
            self.assertEqual(stats["success"], stats["inference_count"])
            self.assertGreater(stats["execution_count"], 0)
            self.assertEqual(stats["queue_ns"] + stats["compute_ns"], stats["success_ns"])
        for case in cases:
            i = case["index"]
            x = np.load(os.path.join(work, f"x{i}.npy"))
            dtype = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16"}[case["datatype"]]
            want, routing = self.forward(int(case["model"].rsplit("-", 1)[1]), x, dtype)
            got = np.load(os.path.join(work, f"y{i}.npy"))
            np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=str(case))
            streamed = np.load(os.path.join(work, f"ys{i}.npy"))  # ModelStreamInfer
            np.testing.assert_array_equal(streamed.astype(np.float32), want, err_msg=str(case))
            np.testing.assert_array_equal(np.load(os.path.join(work, f"ids{i}.npy")).ravel(),
                                          np.asarray(routing.expert_ids).ravel(), err_msg=str(case))

    def test_perf_analyzer(self):
        """Triton's load generator, unchanged, drives ModelInfer: a short run at concurrency 2 on
        bf16 inputs it reads from a JSON file (random bytes would hold NaNs, which are refused)."""
        python = ensure_triton_venv(os.environ.get("MOE_KSERVE_VENV",
                                                   os.path.join(SOURCE_DIR, "build", "kserve-venv")))
        before = self.request_counts(1)
        run = run_perf_analyzer(python, self.tmp.name, 31, "grpc", f"127.0.0.1:{self.port}")
        self.assertEqual(run.returncode, 0, run.stdout[-3000:] + run.stderr[-3000:])
        self.assertIn("Throughput:", run.stdout)
        # The server-side breakdown from the statistics extension (queue and compute).
        self.assertRegex(run.stdout, r"Server:\s*\n\s*Inference count: [1-9]", run.stdout[-3000:])
        self.assertRegex(run.stdout, r"queue \d+ usec \+ compute input \d+ usec \+ compute infer [1-9]\d* usec",
                         run.stdout[-3000:])
        after = self.request_counts(1)
        self.assertGreater(after["OK"] - before["OK"], 10)  # served, and counted as Forward's are
        self.assertEqual({code: after[code] - before[code] for code in after if code != "OK"},
                         {code: 0 for code in after if code != "OK"})


if __name__ == "__main__":
    unittest.main()
