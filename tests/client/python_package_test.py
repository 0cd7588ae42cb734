"""The Python package as a user installs it: `pip install --no-build-isolation --no-index
./client/python` into a `python3 -m venv --system-site-packages` venv (Debian's setuptools,
grpcio, protobuf, numpy; no network), then python_client_test.py run by that venv's Python
against the installed copy (not the source tree); and the committed stubs are what protoc makes
from proto/moe/v1/moe.proto today (their .pyi included); and one version number: CMakeLists.txt's
project VERSION, pyproject.toml's and moe_serve.__version__, installed or not.

Run by ctest (label python) with MOE_PACKAGE_VENV set (a directory under the build tree).
"""

import os
import re
import shutil
import subprocess
import sys
import tomllib
import unittest

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
VENV = os.environ.get("MOE_PACKAGE_VENV", os.path.join(REPO, "build", "python-package-venv"))


def project_version():
    """project(moe_serve ... VERSION x.y.z) of CMakeLists.txt."""
    with open(os.path.join(REPO, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"^project\(\s*moe_serve\b[^)]*\bVERSION\s+(\d+\.\d+\.\d+)\b", f.read(), re.M)
    assert match, "CMakeLists.txt has no project(moe_serve ... VERSION x.y.z)"
    return match.group(1)


class PythonPackageTest(unittest.TestCase):
    def test_stubs_match_the_proto(self):
        check = subprocess.run([sys.executable, os.path.join(REPO, "client", "python", "generate_stubs.py"),
                                "--check"], capture_output=True, text=True, check=False)
        self.assertEqual(check.returncode, 0, check.stderr)

    def test_one_version_for_server_and_package(self):
        with open(os.path.join(REPO, "client", "python", "pyproject.toml"), "rb") as f:
            self.assertEqual(tomllib.load(f)["project"]["version"], project_version())
        source = subprocess.run([sys.executable, "-c", "import moe_serve; print(moe_serve.__version__)"],
                                cwd=os.path.join(REPO, "client", "python"), capture_output=True, text=True, check=True)
        self.assertEqual(source.stdout.strip(), project_version())

    def test_installs_offline_and_passes_the_client_tests(self):
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", VENV], check=True)
        python = os.path.join(VENV, "bin", "python")
        # A copy: pip builds in the source directory and would leave build/ and *.egg-info there.
        source = os.path.join(VENV, "src")
        shutil.copytree(os.path.join(REPO, "client", "python"), source)
        pip = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-index",
                              "--disable-pip-version-check", source], capture_output=True, text=True, check=False)
        self.assertEqual(pip.returncode, 0, pip.stdout + pip.stderr)
        where = subprocess.run([python, "-c", "import moe_serve; print(moe_serve.__file__)"], cwd="/",
                               capture_output=True, text=True, check=True).stdout.strip()
        self.assertTrue(where.startswith(VENV), where)
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(where), "py.typed")))
        for stub in ("moe_pb2.pyi", "moe_pb2_grpc.pyi"):
            self.assertTrue(os.path.exists(os.path.join(os.path.dirname(where), "_stubs", stub)), stub)
        versions = subprocess.run([python, "-c", "import importlib.metadata, moe_serve; "
                                   "print(moe_serve.__version__, importlib.metadata.version('moe-serve-client'))"],
                                  cwd="/", capture_output=True, text=True, check=True).stdout.split()
        self.assertEqual(versions, [project_version()] * 2)
        run = subprocess.run([python, os.path.join(REPO, "tests", "client", "python_client_test.py")],
                             env=dict(os.environ, MOE_PY_INSTALLED="1"), capture_output=True, text=True,
                             check=False, timeout=300)
        self.assertEqual(run.returncode, 0, run.stdout[-3000:] + run.stderr[-5000:])
        self.assertIn("OK", run.stderr)
        script = os.path.join(VENV, "bin", "moe-serve-client")
        usage = subprocess.run([script, "--help"], capture_output=True, text=True, check=False)
        self.assertEqual(usage.returncode, 0, usage.stderr)
        self.assertIn("--target", usage.stdout)


if __name__ == "__main__":
    unittest.main()
