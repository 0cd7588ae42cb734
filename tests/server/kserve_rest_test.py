"""The Open Inference Protocol over HTTP/REST (--http-port) against real processes on loopback
(moe-cluster: gateway + 2 ranks, k3-mini, an API token), with curl and tritonclient.http:

- every output bit-identical to moe.v1 Forward on the same gateway, for JSON and binary tensors
  (FP32, FP16, BF16 inputs; 1, 3, 257 tokens), BF16 outputs as JSON numbers read back exactly;
- health open, everything else behind the token (401 before the body is read), an oversized
  Content-Length refused (413) without the gateway's memory growing, malformed bodies 400 with
  where, unknown models 404, wrong methods 405;
- requests counted in the gateway's metrics as the gRPC APIs' are; statistics, model config and
  the repository index served as tritonclient reads them; perf_analyzer -i http runs unchanged.
Run by ctest (labels python, service) with MOE_BIN_DIR, MOE_PYTHON_STUBS and MOE_KSERVE_VENV set.
"""

import json
import os
import socket
import subprocess
import sys
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kserve_service_test import (HIDDEN, MAX_TOKENS, TOP_K, bf16_bytes, bf16_round,  # noqa: E402
                                 ensure_triton_venv, metric_value, run_perf_analyzer)
from python_client_service_test import SOURCE_DIR, ClusterFixture, free_port  # noqa: E402

TOKEN = "rest-test-token-5f1c"


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class KServeRestTest(ClusterFixture):
    @classmethod
    def prepare(cls):
        cls.http_port = free_port()
        cls.metrics_port = free_port()
        token_file = os.path.join(cls.tmp.name, "api.token")
        with open(token_file, "w") as f:
            f.write(TOKEN + "\n")
        cls.gateway_flags = ["--max-request-tokens", str(MAX_TOKENS), "--api-token-file", token_file,
                             "--http-port", str(cls.http_port), "--metrics-port", str(cls.metrics_port)]

    @classmethod
    def client_kwargs(cls):
        return {"token": TOKEN}

    def url(self, path):
        return f"http://127.0.0.1:{self.http_port}{path}"

    def curl(self, path, *args, token=TOKEN, data=None, headers=()):
        """(HTTP status, body bytes, response headers) of one curl call."""
        command = ["curl", "-sS", "-o", "-", "-D", os.path.join(self.tmp.name, "headers"),
                   "-w", "\n%{http_code}", "--max-time", "60", self.url(path), *args]
        if token:
            command += ["-H", f"Authorization: Bearer {token}"]
        for header in headers:
            command += ["-H", header]
        if data is not None:
            path_in = os.path.join(self.tmp.name, "body")
            with open(path_in, "wb") as f:
                f.write(data)
            command += ["--data-binary", "@" + path_in]
        run = subprocess.run(command, capture_output=True, timeout=90)
        self.assertEqual(run.returncode, 0, run.stderr)
        body, _, code = run.stdout.rpartition(b"\n")
        with open(os.path.join(self.tmp.name, "headers")) as f:
            head = {k.strip().lower(): v.strip() for k, _, v in
                    (line.partition(":") for line in f.read().splitlines()[1:] if ":" in line)}
        return int(code), body, head

    def forward(self, layer, x, dtype, output_dtype=None):
        y, routing = self.client.forward(layer, x, dtype=dtype, return_routing=True,
                                         output_dtype=output_dtype or dtype)
        return np.asarray(y, np.float32), routing

    def test_health_is_open_and_the_rest_needs_the_token(self):
        self.assertEqual(self.curl("/v2/health/live", token=None)[0], 200)
        code, body, _ = self.curl("/v2/health/ready", token=None)
        self.assertEqual((code, json.loads(body)), (200, {"ready": True}))
        self.assertEqual(self.curl("/v2/models/moe-layer-1/ready", token=None)[0], 200)
        self.assertEqual(self.curl("/v2/models/moe-layer-9/ready", token=None)[0], 503)
        for path in ("/v2", "/v2/models/moe-layer-1", "/v2/models/moe-layer-1/config", "/v2/models/stats"):
            code, body, head = self.curl(path, token=None)
            self.assertEqual(code, 401, path)
            self.assertEqual(head.get("www-authenticate"), "Bearer")
            self.assertIn("no API token", json.loads(body)["error"])
            self.assertEqual(self.curl(path, token="wrong")[0], 401, path)
        code, body, _ = self.curl("/v2")
        self.assertEqual(code, 200)
        meta = json.loads(body)
        self.assertEqual(meta["name"], "moe-gateway")
        self.assertIn("binary_tensor_data", meta["extensions"])
        code, body, _ = self.curl("/v2/models/moe-layer-2")
        self.assertEqual(code, 200)
        model = json.loads(body)
        self.assertEqual(model["inputs"], [{"name": "hidden_states", "datatype": "BF16", "shape": [-1, HIDDEN]}])
        self.assertEqual([o["name"] for o in model["outputs"]], ["output", "expert_ids", "routing_weights"])
        self.assertEqual(self.curl("/v2/models/moe-layer-9")[0], 404)
        self.assertEqual(self.curl("/v2/models/moe-layer-1/versions/2")[0], 404)
        self.assertEqual(self.curl("/v2/models/moe-layer-1/infer")[0], 405)  # GET
        self.assertEqual(self.curl("/v2/models/moe-layer-1", "-X", "DELETE")[0], 405)
        self.assertEqual(self.curl("/v2/nothing/here")[0], 404)

    def test_curl_json_and_binary_outputs_match_forward(self):
        rng = np.random.default_rng(41)
        # JSON text takes ~4x the bytes of binary data: 257 tokens as JSON would pass this
        # gateway's --max-request-bytes (sized for 300 binary tokens), so JSON stops at 64.
        for layer, tokens, json_tokens in [(1, 1, 1), (2, 3, 3), (1, 257, 64)]:
            x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
            x_json = x[:json_tokens]
            request = {"id": f"c{tokens}", "inputs": [{"name": "hidden_states", "shape": [json_tokens, HIDDEN],
                                                       "datatype": "FP32", "data": x_json.tolist()}],
                       "outputs": [{"name": "output"}, {"name": "expert_ids"}, {"name": "routing_weights"}]}
            code, body, head = self.curl(f"/v2/models/moe-layer-{layer}/infer",
                                         data=json.dumps(request).encode(), headers=["Content-Type: application/json"])
            self.assertEqual(code, 200, body[:300])
            self.assertEqual(head["content-type"], "application/json")
            response = json.loads(body)
            self.assertEqual((response["model_name"], response["id"]), (f"moe-layer-{layer}", f"c{tokens}"))
            want, routing = self.forward(layer, x_json, "fp32")
            out = response["outputs"][0]
            self.assertEqual((out["datatype"], out["shape"]), ("FP32", [json_tokens, HIDDEN]))
            np.testing.assert_array_equal(np.asarray(out["data"], np.float32).reshape(json_tokens, HIDDEN), want)
            np.testing.assert_array_equal(np.asarray(response["outputs"][1]["data"]).ravel(),
                                          np.asarray(routing.expert_ids).ravel())
            np.testing.assert_array_equal(np.asarray(response["outputs"][2]["data"], np.float32).ravel(),
                                          np.asarray(routing.weights, np.float32).ravel())
            self.assertEqual(response["outputs"][1]["shape"], [json_tokens, TOP_K])
            # The same call with a BF16 binary input and a binary BF16 output.
            header = json.dumps({"inputs": [{"name": "hidden_states", "shape": [tokens, HIDDEN], "datatype": "BF16",
                                             "parameters": {"binary_data_size": tokens * HIDDEN * 2}}],
                                 "parameters": {"binary_data_output": True}}).encode()
            code, body, head = self.curl(f"/v2/models/moe-layer-{layer}/infer", data=header + bf16_bytes(x),
                                         headers=[f"Inference-Header-Content-Length: {len(header)}",
                                                  "Content-Type: application/octet-stream"])
            self.assertEqual(code, 200, body[:300])
            split = int(head["inference-header-content-length"])
            meta = json.loads(body[:split])
            self.assertEqual(meta["outputs"][0]["parameters"]["binary_data_size"], tokens * HIDDEN * 2)
            want_bf16, _ = self.forward(layer, bf16_round(x), "bf16")
            got = (np.frombuffer(body[split:], np.uint16).astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got.reshape(tokens, HIDDEN), want_bf16)
            # BF16 outputs as JSON numbers: exact, so they read back to the same bits.
            request["parameters"] = {"output_datatype": "BF16"}
            request["outputs"] = [{"name": "output"}]
            code, body, _ = self.curl(f"/v2/models/moe-layer-{layer}/infer", data=json.dumps(request).encode())
            self.assertEqual(code, 200, body[:300])
            got = np.asarray(json.loads(body)["outputs"][0]["data"], np.float64)
            want_out, _ = self.forward(layer, x_json, "fp32", output_dtype="bf16")
            np.testing.assert_array_equal(got.reshape(json_tokens, HIDDEN), want_out.astype(np.float64))

    def test_bad_bodies_get_precise_errors_and_counted(self):
        before = self.request_counts(1)
        x = np.random.default_rng(5).standard_normal((2, HIDDEN)).astype(np.float32)

        def infer(body, headers=()):
            code, text, _ = self.curl("/v2/models/moe-layer-1/infer", data=body, headers=headers)
            return code, json.loads(text)["error"]

        self.assertEqual(infer(b"{not json")[0], 400)
        code, error = infer(json.dumps({"inputs": [{"name": "hidden_states", "shape": [2, 64], "datatype": "FP32",
                                                    "data": x[:, :64].ravel().tolist()}]}).encode())
        self.assertEqual(code, 400)
        self.assertIn("hidden", error)
        bad = x.astype(np.float64).ravel().tolist()
        bad[HIDDEN + 3] = 1e39  # beyond fp32: read as infinity, refused as a non-finite value
        code, error = infer(json.dumps({"inputs": [{"name": "hidden_states", "shape": [2, HIDDEN], "datatype": "FP32",
                                                    "data": bad}]}).encode())
        self.assertEqual(code, 400, error)
        self.assertIn("token 1", error)
        code, error = infer(json.dumps({"inputs": [{"name": "hidden_states", "shape": [MAX_TOKENS + 1, HIDDEN],
                                                    "datatype": "BF16",
                                                    "parameters": {"binary_data_size": (MAX_TOKENS + 1) * HIDDEN * 2}}]}
                                       ).encode() + b"\x3f\x80" * ((MAX_TOKENS + 1) * HIDDEN),
                            headers=[])
        self.assertEqual(code, 400)  # binary data without its header length: the JSON is not JSON
        header = json.dumps({"inputs": [{"name": "hidden_states", "shape": [MAX_TOKENS + 1, HIDDEN], "datatype": "BF16",
                                         "parameters": {"binary_data_size": (MAX_TOKENS + 1) * HIDDEN * 2}}]}).encode()
        code, error = infer(header + b"\x80\x3f" * ((MAX_TOKENS + 1) * HIDDEN),
                            headers=[f"Inference-Header-Content-Length: {len(header)}"])
        self.assertEqual(code, 429, error)  # RESOURCE_EXHAUSTED: more tokens than --max-request-tokens
        code, error = infer(json.dumps({"inputs": []}).encode())
        self.assertEqual(code, 400)
        code, error = infer(header, headers=["Inference-Header-Content-Length: twelve"])
        self.assertEqual(code, 400)
        self.assertIn("Inference-Header-Content-Length is not a byte count", error)
        code, error = infer(json.dumps({"inputs": [{"name": "hidden_states", "shape": [1, HIDDEN], "datatype": "FP32",
                                                    "data": [[[[1.0] * HIDDEN]]]}], "outputs": [{"name": "logits"}]}
                                       ).encode())
        self.assertEqual(code, 400)
        self.assertIn("unknown output 'logits'", error)
        code, _, _ = self.curl("/v2/models/moe-layer-9/infer", data=b"{}")
        self.assertEqual(code, 404)
        after = self.request_counts(1)
        # Every refusal above is counted under the layer its URL names (the 404 under none).
        self.assertEqual(after["INVALID_ARGUMENT"] - before["INVALID_ARGUMENT"], 7)
        self.assertEqual(after["RESOURCE_EXHAUSTED"] - before["RESOURCE_EXHAUSTED"], 1)

    def raw_post(self, content_length, token, send_bytes):
        """A POST declaring `content_length` and sending `send_bytes` of it: (status line, seconds)."""
        with socket.create_connection(("127.0.0.1", self.http_port), timeout=10) as s:
            auth = f"Authorization: Bearer {token}\r\n" if token else ""
            start = time.monotonic()
            s.sendall(f"POST /v2/models/moe-layer-1/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {content_length}"
                      f"\r\n{auth}\r\n".encode() + b"[" * send_bytes)
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
            return reply.split(b"\r\n", 1)[0].decode(), time.monotonic() - start

    def test_large_bodies_are_refused_from_their_headers(self):
        pid = int(subprocess.run(["pgrep", "-f", f"moe-gateway.*--http-port {self.http_port}"],
                                 capture_output=True, text=True).stdout.split()[0])
        before = rss_kb(pid)
        for _ in range(4):
            status, seconds = self.raw_post(1 << 30, None, 1 << 20)
            self.assertIn(" 401 ", status)
            self.assertLess(seconds, 5)
            status, seconds = self.raw_post(1 << 30, TOKEN, 1 << 20)
            self.assertIn(" 413 ", status)
            self.assertLess(seconds, 5)
        # Nothing of the declared gigabytes was allocated (a few MB of noise: threads, pages).
        self.assertLess(rss_kb(pid) - before, 64 << 10)

    def request_counts(self, layer):
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        codes = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED")
        return {code: metric_value(text, "moe_requests_total", {"layer": str(layer), "code": code}) for code in codes}

    def test_tritonclient_http(self):
        python = ensure_triton_venv(os.environ.get("MOE_KSERVE_VENV", os.path.join(SOURCE_DIR, "build", "kserve-venv")))
        rng = np.random.default_rng(43)
        work = os.path.join(self.tmp.name, "triton-http")
        os.makedirs(work, exist_ok=True)
        cases = []
        for i, (layer, tokens, datatype, binary) in enumerate([(1, 1, "FP32", True), (2, 3, "FP16", True),
                                                                (1, 257, "BF16", True), (2, 4, "FP32", False)]):
            x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
            if datatype == "BF16":
                x = bf16_round(x)
            np.save(os.path.join(work, f"x{i}.npy"), x)
            cases.append({"index": i, "model": f"moe-layer-{layer}", "datatype": datatype, "binary": binary})
        with open(os.path.join(work, "cases.json"), "w") as f:
            json.dump(cases, f)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kserve_tritonclient_http_check.py")
        check = subprocess.run([python, script, f"127.0.0.1:{self.http_port}", work, TOKEN],
                               capture_output=True, text=True, timeout=300)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        with open(os.path.join(work, "report.json")) as f:
            report = json.load(f)
        self.assertTrue(report["live"] and report["ready"] and report["model_ready"])
        self.assertFalse(report["unknown_model_ready"])
        self.assertEqual(report["unauthenticated"], 401)
        self.assertEqual(report["config"]["input"][0]["dims"], [-1, HIDDEN])
        self.assertEqual(report["index"], [["moe-layer-1", "1", "READY"], ["moe-layer-2", "1", "READY"]])
        stats = report["stats"]["moe-layer-1"]
        self.assertGreaterEqual(stats["inference_count"], sum(1 for c in cases if c["model"] == "moe-layer-1"))
        self.assertEqual(stats["queue_ns"] + stats["compute_ns"], stats["success_ns"])
        for case in cases:
            i = case["index"]
            x = np.load(os.path.join(work, f"x{i}.npy"))
            dtype = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16"}[case["datatype"]]
            want, routing = self.forward(int(case["model"].rsplit("-", 1)[1]), x, dtype)
            np.testing.assert_array_equal(np.load(os.path.join(work, f"y{i}.npy")).astype(np.float32), want,
                                          err_msg=str(case))
            np.testing.assert_array_equal(np.load(os.path.join(work, f"ids{i}.npy")).ravel(),
                                          np.asarray(routing.expert_ids).ravel(), err_msg=str(case))

    def test_perf_analyzer_http(self):
        python = ensure_triton_venv(os.environ.get("MOE_KSERVE_VENV", os.path.join(SOURCE_DIR, "build", "kserve-venv")))
        before = self.request_counts(1)
        run = run_perf_analyzer(python, self.tmp.name, 47, "http", f"127.0.0.1:{self.http_port}",
                                ["-H", f"Authorization: Bearer {TOKEN}"])
        self.assertEqual(run.returncode, 0, run.stdout[-3000:] + run.stderr[-3000:])
        self.assertIn("Throughput:", run.stdout)
        self.assertRegex(run.stdout, r"queue \d+ usec \+ compute input \d+ usec \+ compute infer [1-9]\d* usec",
                         run.stdout[-3000:])
        after = self.request_counts(1)
        self.assertGreater(after["OK"] - before["OK"], 10)
        self.assertEqual(after["INVALID_ARGUMENT"], before["INVALID_ARGUMENT"])


if __name__ == "__main__":
    unittest.main()
