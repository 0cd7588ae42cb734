"""Tensors to and from moe.v1.Tensor: numpy arrays (ml_dtypes.bfloat16 included) and torch tensors.

Wire values are little-endian raw bytes. bf16 from float32 rounds to nearest even (NaN stays a
quiet NaN); a torch.bfloat16 tensor or an ml_dtypes.bfloat16 array goes out as its own bits,
unchanged. torch and ml_dtypes are optional: neither is imported here (an input of either kind
means its module is loaded already).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, Literal, Optional, TypeVar, Union, cast, overload

import numpy as np
import numpy.typing as npt

from ._stubs import moe_pb2

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeGuard

DTypeName = Literal["bf16", "fp16", "fp32"]
DTYPES: Dict[str, moe_pb2.DType] = {"bf16": moe_pb2.BF16, "fp16": moe_pb2.FP16, "fp32": moe_pb2.FP32}
_NAMES: Dict[int, DTypeName] = {moe_pb2.BF16: "bf16", moe_pb2.FP16: "fp16", moe_pb2.FP32: "fp32"}

# What comes back for a numpy input: float32, or float16 for an fp16 output (numpy has no bf16,
# so a bf16 output decodes to float32, exactly).
FloatArray = npt.NDArray[np.floating[Any]]
# Hidden states in and the output out: a numpy array of floats (float16/32/64, or
# ml_dtypes.bfloat16) gives a FloatArray back; a torch tensor, a torch tensor.
Hidden = TypeVar("Hidden", FloatArray, "torch.Tensor")
TensorIn = Union[npt.NDArray[Any], "torch.Tensor"]

_ACCEPTED = "float16, float32, float64 or ml_dtypes.bfloat16 (numpy), a floating torch dtype"


def is_torch(x: object) -> TypeGuard[torch.Tensor]:
    module = sys.modules.get("torch")
    return module is not None and isinstance(x, module.Tensor)


def _is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """An ml_dtypes.bfloat16 array's dtype (numpy's kind "V": no numpy float type)."""
    module = sys.modules.get("ml_dtypes")
    return module is not None and dtype.kind == "V" and bool(dtype == np.dtype(module.bfloat16))


def wire_dtype(name: Optional[str]) -> moe_pb2.DType:
    if name is None or name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _numpy_kind(x: npt.NDArray[Any]) -> DTypeName:
    """The wire dtype that carries a numpy array unchanged; TypeError for one that is not floats."""
    if _is_bfloat16(x.dtype):
        return "bf16"
    if x.dtype == np.float16:
        return "fp16"
    if np.issubdtype(x.dtype, np.floating):
        return "fp32"  # float32; float64 (numpy's default) is rounded to float32
    hint = " (x.astype(np.float32) converts it)" if x.dtype.kind in "biu" else ""
    raise TypeError(f"hidden states must be floating point ({_ACCEPTED}); got a numpy array of "
                    f"dtype {x.dtype}{hint}")


def check_input(x: object) -> None:
    """TypeError naming the problem for what is neither a numpy array nor a torch tensor of floats."""
    if is_torch(x):
        if not x.is_floating_point():
            raise TypeError(f"hidden states must be floating point ({_ACCEPTED}); got a torch tensor of "
                            f"dtype {x.dtype} (x.float() converts it)")
        return
    if isinstance(x, np.ndarray):
        _numpy_kind(x)
        return
    hint = " (np.asarray(x, dtype=np.float32) makes one)" if isinstance(x, (list, tuple)) else ""
    raise TypeError(f"hidden states must be a numpy array or a torch tensor; got {type(x).__name__}{hint}")


def natural_dtype(x: TensorIn) -> DTypeName:
    """The wire dtype that carries x without rounding: bf16 for torch.bfloat16 and
    ml_dtypes.bfloat16, fp16 for half precision, fp32 for the rest (float64 is rounded)."""
    check_input(x)
    if is_torch(x):
        module = sys.modules["torch"]
        if x.dtype == module.bfloat16:
            return "bf16"
        return "fp16" if x.dtype == module.float16 else "fp32"
    return _numpy_kind(cast("npt.NDArray[Any]", x))


def bf16_bits(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_to_float32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_tensor(x: TensorIn, dtype: Optional[DTypeName] = None) -> moe_pb2.Tensor:
    """numpy array or torch tensor -> moe.v1.Tensor of wire `dtype` (default: natural_dtype).

    TypeError for anything else (a Python list, an integer array) and for a dtype the service
    does not take; ValueError for an unknown wire dtype."""
    natural = natural_dtype(x)  # TypeError for what the service does not take
    dtype = dtype or natural
    code = wire_dtype(dtype)
    shape = [int(n) for n in x.shape]
    if is_torch(x):
        module = sys.modules["torch"]
        t = x.detach().cpu().contiguous()
        if dtype == "bf16" and t.dtype == module.bfloat16:
            bits: bytes = t.view(module.int16).numpy().astype("<i2").tobytes()
            return moe_pb2.Tensor(dtype=code, shape=shape, data=bits)
        if dtype == "fp16" and t.dtype == module.float16:
            half: bytes = t.numpy().astype("<f2").tobytes()
            return moe_pb2.Tensor(dtype=code, shape=shape, data=half)
        array: npt.NDArray[Any] = t.to(module.float32).numpy()
    else:
        array = cast("npt.NDArray[Any]", x)
        if _is_bfloat16(array.dtype):
            if dtype == "bf16":  # its own bits
                bits = np.ascontiguousarray(array).view(np.uint16).astype("<u2").tobytes()
                return moe_pb2.Tensor(dtype=code, shape=shape, data=bits)
            array = array.astype(np.float32)  # exact
    if dtype == "fp32":
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
    elif dtype == "fp16":
        data = np.ascontiguousarray(array, dtype="<f2").tobytes()
    else:
        data = bf16_bits(array.astype(np.float32)).astype("<u2").tobytes()
    return moe_pb2.Tensor(dtype=code, shape=shape, data=data)


def _flat(tensor: moe_pb2.Tensor) -> npt.NDArray[Any]:
    shape = tuple(int(n) for n in tensor.shape)
    flat: npt.NDArray[Any]
    if tensor.dtype == moe_pb2.FP32:
        flat = np.frombuffer(tensor.data, dtype="<f4")
    elif tensor.dtype in (moe_pb2.FP16, moe_pb2.BF16):
        flat = np.frombuffer(tensor.data, dtype="<u2" if tensor.dtype == moe_pb2.BF16 else "<f2")
    else:
        raise ValueError(f"unsupported tensor dtype {tensor.dtype}")
    if flat.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"tensor of shape {shape} carries {flat.size} values")
    return flat.reshape(shape)


def _decode_numpy(tensor: moe_pb2.Tensor) -> FloatArray:
    flat = _flat(tensor)
    if tensor.dtype == moe_pb2.BF16:
        return bf16_to_float32(flat)
    out: FloatArray = flat.astype(flat.dtype.newbyteorder("="))  # a native-order copy
    return out


def _decode_torch(tensor: moe_pb2.Tensor, like: torch.Tensor) -> torch.Tensor:
    module = sys.modules["torch"]
    flat = _flat(tensor)
    if tensor.dtype == moe_pb2.BF16:
        out = module.from_numpy(flat.view(np.int16).astype(np.int16)).view(module.bfloat16)
    else:
        out = module.from_numpy(flat.astype(flat.dtype.newbyteorder("=")))
    result: torch.Tensor = out.to(like.device)
    return result


@overload
def decode_tensor(tensor: moe_pb2.Tensor, like: None = None) -> FloatArray: ...
@overload
def decode_tensor(tensor: moe_pb2.Tensor, like: Hidden) -> Hidden: ...
def decode_tensor(tensor: moe_pb2.Tensor, like: Optional[TensorIn] = None) -> TensorIn:
    """moe.v1.Tensor -> an array of its shape, exact for every dtype.

    numpy (the default, and for a numpy `like`): float32 for FP32 and BF16 (numpy has no bf16),
    float16 for FP16. torch (when `like` is a torch tensor): torch.float32 / float16 / bfloat16,
    on like's device.
    """
    if like is not None and is_torch(like):
        return _decode_torch(tensor, like)
    return _decode_numpy(tensor)


def dtype_name(code: int) -> DTypeName:
    return _NAMES[code]
