"""moe_serve's types and its optional bfloat16 input, with pinned tools from PyPI.

A `python3 -m venv --system-site-packages` venv (Debian's grpcio, protobuf, numpy, torch) gets
client/python/typecheck-requirements.txt (mypy, the grpcio and protobuf stubs, ml_dtypes; made
once per build tree, again when the pins change) and the package, installed from a copy of
client/python. Then:

- mypy --strict over the package (client/python/pyproject.toml's [tool.mypy]);
- mypy --strict over every Python example that imports moe_serve in client/python/README.md (at
  least one), README.md and docs/*.md, against the installed package as a user's code sees it;
- the types are the precise ones (revealed types of forward, forward_stream, the async client;
  lists and integer arrays refused);
- python_client_test.py (fake server) and python_client_service_test.py's PythonClientServiceTest
  (moe-cluster) in that venv with MOE_REQUIRE_ML_DTYPES=1: the bfloat16 tests run, not skip.

PyPI unreachable: the test fails, saying so. Run by ctest (labels python, service) with
MOE_TYPECHECK_VENV (a directory under the build tree) and MOE_BIN_DIR set.
"""

import glob
import os
import re
import shutil
import subprocess
import tempfile
import unittest

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PACKAGE = os.path.join(REPO, "client", "python")
REQUIREMENTS = os.path.join(PACKAGE, "typecheck-requirements.txt")
VENV = os.environ.get("MOE_TYPECHECK_VENV", os.path.join(REPO, "build", "python-typecheck-venv"))
BIN = os.environ.get("MOE_BIN_DIR", os.path.join(REPO, "build", "bin"))

# What mypy reveals for the calls in PRECISION below, one per reveal_type, in order.
FLOATS = "numpy.ndarray[Any, numpy.dtype[numpy.floating[Any]]]"
PRECISION = '''
import numpy as np
import torch
import ml_dtypes
from moe_serve import AsyncMoeClient, MoeClient, moe_pb2, moe_pb2_grpc

def blocking(client: MoeClient, x: "np.ndarray[Any, np.dtype[np.float32]]", flag: bool) -> None:
    reveal_type(client.forward(1, x))
    reveal_type(client.forward(1, x, return_routing=True))
    reveal_type(client.forward(1, x, return_routing=flag))
    reveal_type(client.forward(1, torch.zeros(2, 8), return_routing=True))
    reveal_type(client.forward(1, x.astype(ml_dtypes.bfloat16))[0])
    for y, routing in client.forward_stream(1, [x, x], return_routing=True):
        reveal_type(routing)
    reveal_type(client.info())
    reveal_type(moe_pb2_grpc.MoeServiceStub(None).Forward)  # E: a grpc.Channel, not None
    client.forward(1, [[0.5]])  # E: a list is no input
    client.forward(1, np.ones((2, 8), np.int64))  # E: nor an integer array
    client.forward(1, x, dtype="int8")  # E: nor a dtype the wire has

async def asynchronous(client: AsyncMoeClient, x: "np.ndarray[Any, np.dtype[np.float16]]") -> None:
    reveal_type(await client.forward(1, x, return_routing=True))
    async for y, routing in client.forward_stream(1, [x]):
        reveal_type(routing)
    reveal_type(await client.placement_advice())
    reveal_type(await client.set_router_bias(1, []))
'''
REVEALED = [
    f"tuple[{FLOATS}, None]",
    f"tuple[{FLOATS}, moe_serve.client.Routing]",
    f"tuple[{FLOATS}, moe_serve.client.Routing | None]",
    "tuple[torch._tensor.Tensor, moe_serve.client.Routing]",
    FLOATS,
    "moe_serve.client.Routing",
    "moe_serve._stubs.moe_pb2.ModelInfo",
    "grpc.UnaryUnaryMultiCallable[moe_serve._stubs.moe_pb2.ForwardRequest, moe_serve._stubs.moe_pb2.ForwardResponse]",
    f"tuple[{FLOATS}, moe_serve.client.Routing]",
    "None",
    "moe_serve._stubs.moe_pb2.PlacementAdvice",
    "moe_serve._stubs.moe_pb2.SetRouterBiasResponse",
]


def ensure_venv():
    """VENV with REQUIREMENTS and the package as it is now; its python."""
    python = os.path.join(VENV, "bin", "python")
    stamp = os.path.join(VENV, "moe-requirements.txt")
    with open(REQUIREMENTS, encoding="utf-8") as f:
        want = f.read()
    current = None
    if os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as f:
            current = f.read()
    if current != want:
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--clear", "--system-site-packages", VENV], check=True)
        pip = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "-r", REQUIREMENTS], capture_output=True, text=True, timeout=600, check=False)
        if pip.returncode != 0:
            raise RuntimeError(f"could not install {REQUIREMENTS} from PyPI into {VENV} (is PyPI reachable?):\n"
                               + pip.stdout[-2000:] + pip.stderr[-3000:])
        with open(stamp, "w", encoding="utf-8") as f:
            f.write(want)
    # The package from a copy (pip builds in the source directory), offline.
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "python")
        shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        pip = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                              "--no-build-isolation", "--no-index", "--force-reinstall", source],
                             capture_output=True, text=True, check=False)
        if pip.returncode != 0:
            raise RuntimeError("could not install client/python into the venv:\n" + pip.stdout + pip.stderr)
    return python


def python_examples(path):
    """The Python programs in a Markdown file that import moe_serve: ```python blocks and the
    `python - <<'PY'` heredocs of shell blocks."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    blocks += re.findall(r"<<'PY'\n(.*?)^PY$", text, re.S | re.M)
    return [b for b in blocks if re.search(r"^(from moe_serve import|import moe_serve)", b, re.M)]


class PythonTypecheckTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.python = ensure_venv()
        cls.cache = os.path.join(VENV, "mypy-cache")

    def mypy(self, *args, cwd):
        return subprocess.run([self.python, "-m", "mypy", "--cache-dir", self.cache, *args], cwd=cwd,
                              capture_output=True, text=True, check=False, timeout=600)

    def test_the_venv_keeps_debians_packages(self):
        where = subprocess.run([self.python, "-c", "import numpy, grpc, google.protobuf, moe_serve, ml_dtypes; "
                                "print(numpy.__file__, grpc.__file__, google.protobuf.__file__, moe_serve.__file__, "
                                "moe_serve.__version__)"],
                               capture_output=True, text=True, check=True, cwd="/").stdout.split()
        for module in where[:3]:  # pip brought no numpy, grpcio or protobuf of its own
            self.assertTrue(module.startswith("/usr/lib/python3/dist-packages/"), module)
        self.assertTrue(where[3].startswith(VENV), where[3])

    def test_package_is_strict_clean(self):
        files = len(glob.glob(os.path.join(PACKAGE, "moe_serve", "**", "*.py"), recursive=True))
        run = self.mypy("--config-file", os.path.join(PACKAGE, "pyproject.toml"), "--strict", "-p", "moe_serve",
                        cwd=PACKAGE)  # the source tree's package comes first
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn(f"Success: no issues found in {files} source files", run.stdout)

    def test_readme_examples_are_strict_clean(self):
        examples = {}
        for page in ["client/python/README.md", "README.md", *sorted(
                os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]:
            for i, block in enumerate(python_examples(os.path.join(REPO, page))):
                examples[f"{re.sub(r'[^A-Za-z0-9]', '_', page)}_{i}.py"] = block
        self.assertTrue(any(name.startswith("client_python_README") for name in examples), examples.keys())
        with tempfile.TemporaryDirectory() as tmp:  # no moe_serve here: the installed one
            for name, block in examples.items():
                with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                    f.write(block)
            run = self.mypy("--strict", *sorted(examples), cwd=tmp)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn(f"Success: no issues found in {len(examples)} source files", run.stdout)

    def test_types_are_precise(self):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "precision.py"), "w", encoding="utf-8") as f:
                f.write("from typing import Any\n" + PRECISION)
            run = self.mypy("--strict", "precision.py", cwd=tmp)
        lines = (run.stdout + run.stderr).splitlines()
        revealed = [line.split('Revealed type is "', 1)[1].rstrip('"') for line in lines if "Revealed type" in line]
        # mypy writes Optional as Union[X, None] for Pythons before 3.10.
        revealed = [re.sub(r"Union\[([\w.]+), None\]", r"\1 | None", r) for r in revealed]
        self.assertEqual(revealed, REVEALED, run.stdout)
        source = ("from typing import Any\n" + PRECISION).splitlines()
        expected = {i + 1 for i, line in enumerate(source) if "# E:" in line}
        errors = {int(line.split(":")[1]) for line in lines if ": error:" in line}
        self.assertEqual(errors, expected, run.stdout)
        self.assertEqual(run.returncode, 1, run.stdout)

    def run_tests(self, script, *args, env=None):
        run = subprocess.run([self.python, os.path.join(REPO, "tests", script), *args],
                             env=dict(os.environ, MOE_REQUIRE_ML_DTYPES="1", **(env or {})),
                             capture_output=True, text=True, check=False, timeout=600)
        self.assertEqual(run.returncode, 0, run.stdout[-3000:] + run.stderr[-6000:])
        self.assertRegex(run.stderr, r"\nOK\b")
        return run.stderr

    def test_client_tests_with_ml_dtypes(self):
        out = self.run_tests(os.path.join("client", "python_client_test.py"), "-v", env={"MOE_PY_INSTALLED": "1"})
        self.assertIn("test_bfloat16_arrays_go_as_their_bits (__main__.PythonClientTest"
                      ".test_bfloat16_arrays_go_as_their_bits) ... ok", out)

    def test_service_tests_with_ml_dtypes(self):
        out = self.run_tests(os.path.join("server", "python_client_service_test.py"), "-v", "PythonClientServiceTest",
                             env={"MOE_BIN_DIR": BIN})
        self.assertIn("test_bfloat16_array_input (__main__.PythonClientServiceTest"
                      ".test_bfloat16_array_input) ... ok", out)


if __name__ == "__main__":
    unittest.main()
