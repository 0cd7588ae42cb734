"""Python client of moe-serve's moe.v1 API (gateway of expert-parallel MoE layers).

    from moe_serve import MoeClient, AsyncMoeClient, MoeError
"""

from ._stubs import moe_pb2, moe_pb2_grpc
from ._tensors import DTypeName, FloatArray, Hidden, decode_tensor, encode_tensor
from .client import AsyncMoeClient, MoeClient, MoeError, Routing, message_limit

__all__ = ["AsyncMoeClient", "DTypeName", "FloatArray", "Hidden", "MoeClient", "MoeError", "Routing",
           "decode_tensor", "encode_tensor", "message_limit", "moe_pb2", "moe_pb2_grpc"]
# One version for the server (CMakeLists.txt's project VERSION), its images and this package
# (pyproject.toml); tests/client/python_package_test.py checks that they agree.
__version__ = "0.9.0"
