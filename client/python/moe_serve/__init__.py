"""Python client of moe-serve's moe.v1 API (gateway of expert-parallel MoE layers).

    from moe_serve import MoeClient, AsyncMoeClient, MoeError
"""

from ._tensors import decode_tensor, encode_tensor
from ._stubs import moe_pb2, moe_pb2_grpc
from .client import AsyncMoeClient, MoeClient, MoeError, Routing, message_limit

__all__ = ["AsyncMoeClient", "MoeClient", "MoeError", "Routing", "decode_tensor", "encode_tensor",
           "message_limit", "moe_pb2", "moe_pb2_grpc"]
__version__ = "0.8.0"
