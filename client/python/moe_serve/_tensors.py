"""Tensors to and from moe.v1.Tensor: numpy arrays and torch tensors, bf16 included.

Wire values are little-endian raw bytes. bf16 from float32 rounds to nearest even (NaN stays a
quiet NaN); a torch.bfloat16 tensor goes out as its own bits, unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._stubs import moe_pb2

DTYPES = {"bf16": moe_pb2.BF16, "fp16": moe_pb2.FP16, "fp32": moe_pb2.FP32}
_NAMES = {v: k for k, v in DTYPES.items()}

try:  # torch is optional: numpy in, numpy out without it
    import torch  # type: ignore
except ImportError:  # pragma: no cover - depends on the host
    torch = None


def is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def wire_dtype(name: str) -> int:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def natural_dtype(x: Any) -> str:
    """The wire dtype that carries x without rounding: bf16 for torch.bfloat16, fp16 for half
    precision, fp32 for everything else (float64 is rounded to float32)."""
    if is_torch(x):
        if x.dtype == torch.bfloat16:
            return "bf16"
        return "fp16" if x.dtype == torch.float16 else "fp32"
    return "fp16" if np.asarray(x).dtype == np.float16 else "fp32"


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_tensor(x: Any, dtype: Optional[str] = None) -> "moe_pb2.Tensor":
    """numpy array or torch tensor -> moe.v1.Tensor of wire `dtype` (default: natural_dtype)."""
    dtype = dtype or natural_dtype(x)
    code = wire_dtype(dtype)
    shape = list(x.shape)
    if is_torch(x):
        t = x.detach().cpu().contiguous()
        if dtype == "bf16" and t.dtype == torch.bfloat16:
            return moe_pb2.Tensor(dtype=code, shape=shape, data=t.view(torch.int16).numpy().tobytes())
        if dtype == "fp16" and t.dtype == torch.float16:
            return moe_pb2.Tensor(dtype=code, shape=shape, data=t.numpy().astype("<f2").tobytes())
        x = t.to(torch.float32).numpy()
    x = np.asarray(x)
    if dtype == "fp32":
        data = np.ascontiguousarray(x, dtype="<f4").tobytes()
    elif dtype == "fp16":
        data = np.ascontiguousarray(x, dtype="<f2").tobytes()
    else:
        data = bf16_bits(x.astype(np.float32)).astype("<u2").tobytes()
    return moe_pb2.Tensor(dtype=code, shape=shape, data=data)


def _flat(tensor: "moe_pb2.Tensor") -> np.ndarray:
    shape = tuple(tensor.shape)
    if tensor.dtype == moe_pb2.FP32:
        flat = np.frombuffer(tensor.data, dtype="<f4")
    elif tensor.dtype in (moe_pb2.FP16, moe_pb2.BF16):
        flat = np.frombuffer(tensor.data, dtype="<u2" if tensor.dtype == moe_pb2.BF16 else "<f2")
    else:
        raise ValueError(f"unsupported tensor dtype {tensor.dtype}")
    if flat.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"tensor of shape {shape} carries {flat.size} values")
    return flat.reshape(shape)


def decode_tensor(tensor: "moe_pb2.Tensor", like: Any = None) -> Any:
    """moe.v1.Tensor -> an array of its shape, exact for every dtype.

    numpy (the default): float32 for FP32 and BF16 (numpy has no bf16), float16 for FP16.
    torch (when `like` is a torch tensor): torch.float32 / float16 / bfloat16, on like's device.
    """
    flat = _flat(tensor)
    if is_torch(like):
        if tensor.dtype == moe_pb2.BF16:
            out = torch.from_numpy(flat.view(np.int16).copy()).view(torch.bfloat16)
        else:
            out = torch.from_numpy(flat.copy())
        return out.to(like.device)
    if tensor.dtype == moe_pb2.BF16:
        return bf16_to_float32(flat)
    return flat.copy()


def dtype_name(code: int) -> str:
    return _NAMES[code]
