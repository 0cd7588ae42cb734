#!/usr/bin/python3
"""Independent Python reference of one MoE layer (Kimi K3 latent MoE, Kimi K2 / DeepSeek-V3 MoE).

This is the golden implementation the C++ layer is tested against. It shares no code with the
C++ project: the safetensors reader, the weight decoders and the layer math are transcribed here
from the format definitions, the seed model code (modeling_kimi_linear.py / modeling_deepseek.py
moe_infer) and docs/DESIGN.md "Numerics".

Numerics policy (the contract, docs/DESIGN.md "Numerics"):
  * All arithmetic is done in the `compute` precision (float64 by default; float32 to keep large
    configs fast). Products of bf16 values are exact in float64, so in float64 every GEMM result
    is the exact dot product up to one fp64 rounding: the reference is the contract's real-number
    formula, evaluated as closely as numpy allows.
  * In bf16 mode values are rounded to bf16 (round to nearest even) at exactly the contract's
    points and nowhere else; the router's combine weights are rounded to fp32 ("weights stay
    fp32"). Rounding goes straight from the compute precision to bf16 (no fp64 -> fp32 -> bf16
    double rounding).
  * In fp32 mode nothing is rounded (the input is taken as given).

CLI:
  /usr/bin/python3 tests/reference/moe_reference.py --checkpoint DIR --layer L --input x.npy \
      --output y.npy [--dtype bf16|fp32] [--compute float64|float32] [--experts-out ids.npy] \
      [--weights-out w.npy] [--near-tie-out mask.npy] [--near-tie-margin 1e-4]

Importable API: see __all__.
"""

import argparse
import concurrent.futures
import dataclasses
import glob
import json
import math
import os
import struct
import sys
from typing import Dict, Optional, Tuple

import numpy as np

__all__ = [
    "MoeConfig", "load_config", "parse_config", "SafetensorsReader", "LayerWeights",
    "round_bf16", "decode_bf16", "decode_f16", "decode_mxfp4", "decode_fp8_e4m3",
    "dequant_fp8_block", "E2M1_MAGNITUDES", "FP8_E4M3_TABLE",
    "select_experts", "route", "moe_layer_forward", "LayerResult", "main",
]

# --------------------------------------------------------------------------------------------
# Number formats
# --------------------------------------------------------------------------------------------


def round_bf16(a):
    """Rounds to the nearest bf16 value (ties to even); returns the same float dtype as `a`.

    float32 input uses the usual bit trick; float64 input is rounded directly (via the binade's
    quantum), so a float64 value just above a bf16 midpoint is not first rounded onto the midpoint
    by an intermediate float32 step. Overflow gives +-inf, NaN stays NaN.
    """
    a = np.asarray(a)
    if a.dtype == np.float32:
        u = a.view(np.uint32)
        is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        # Adding 0x7fff + lsb then truncating is round-to-nearest-even on the kept 16 bits.
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        r = np.where(is_nan, u | np.uint32(0x00400000), r)
        return r.astype(np.uint32).view(np.float32)
    if a.dtype != np.float64:
        raise TypeError("round_bf16 expects float32 or float64, got %s" % a.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        _, e = np.frexp(a)  # a = m * 2^e with 0.5 <= |m| < 1
        # bf16 keeps 8 significant bits: quantum 2^(e-8). Below the smallest normal (2^-126) the
        # quantum stays at the subnormal spacing 2^-133.
        e = np.maximum(e, -125)
        quantum = np.ldexp(1.0, e - 8)
        r = np.rint(a / quantum) * quantum  # rint rounds half to even; the scaling is exact
        # Past the largest finite bf16 (0x7f7f) the value rounds to infinity.
        big = np.abs(r) >= 2.0 ** 128
        r = np.where(big, np.copysign(np.inf, a), r)
        return np.where(np.isfinite(a), r, a)


def decode_bf16(u16):
    """bf16 bit patterns (uint16) -> float32 (exact: bf16 is the top half of an fp32)."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def decode_f16(u16):
    """IEEE binary16 bit patterns (uint16) -> float32 (exact)."""
    return np.asarray(u16, dtype=np.uint16).view(np.float16).astype(np.float32)


# E2M1 (MXFP4 element) magnitudes for codes 0..7; bit 3 is the sign.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
_E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])  # index = 4-bit code
_E2M1_QUADS = {}  # dtype -> [65536, 4] table


def _e2m1_quads(dtype):
    """All four elements of two packed bytes (read as one little-endian u16) at once.

    Byte 0 holds elements 0 (low nibble) and 1; byte 1 holds elements 2 and 3. One gather per
    four values is what keeps a full-size expert's decode at a fraction of a second.
    """
    dtype = np.dtype(dtype)
    if dtype not in _E2M1_QUADS:
        q = np.arange(65536)
        _E2M1_QUADS[dtype] = np.stack([_E2M1_VALUES[(q >> (4 * i)) & 0xF] for i in range(4)],
                                      axis=1).astype(dtype)
    return _E2M1_QUADS[dtype]


def _e8m0_scales(u8):
    """E8M0 shared exponents -> 2^(u8-127) as float64; 0xFF is NaN (OCP MX spec)."""
    u8 = np.asarray(u8, dtype=np.uint8)
    s = np.ldexp(1.0, u8.astype(np.int32) - 127)
    return np.where(u8 == 0xFF, np.nan, s)


def decode_mxfp4(packed, scales, out_dtype=np.float32):
    """MXFP4 (compressed-tensors mxfp4-pack-quantized) -> dense [rows, cols] matrix.

    packed: u8 [rows, cols/2], low nibble = even column; scales: u8 [rows, cols/32].
    Every decoded value is exact in bf16 (and so in float32/float64), except for scale
    exponents so large or small that fp32 itself cannot hold them.
    """
    packed = np.asarray(packed, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    rows, half = packed.shape
    cols = 2 * half
    if cols % 32 or scales.shape != (rows, cols // 32):
        raise ValueError("MXFP4 shapes do not match: packed %s, scales %s"
                         % (packed.shape, scales.shape))
    quads = np.ascontiguousarray(packed).view("<u2")  # cols % 32 == 0: whole u16 per row
    vals = np.take(_e2m1_quads(out_dtype), quads, axis=0).reshape(rows, cols // 32, 32)
    with np.errstate(over="ignore"):
        s = _e8m0_scales(scales).astype(out_dtype)
    np.multiply(vals, s[:, :, None], out=vals)
    return vals.reshape(rows, cols)


def _fp8_e4m3_value(code):
    """The e4m3fn definition, one code at a time: bias 7, no infinities, S.1111.111 is NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> 3) & 0xF
    man = code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** -9  # subnormal: 0.man * 2^(1-7)
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


FP8_E4M3_TABLE = np.array([_fp8_e4m3_value(c) for c in range(256)], dtype=np.float64)


def decode_fp8_e4m3(u8, out_dtype=np.float32):
    """FP8 E4M3 (e4m3fn) codes -> values (exact in float32)."""
    return FP8_E4M3_TABLE.astype(out_dtype)[np.asarray(u8, dtype=np.uint8)]


def dequant_fp8_block(u8, scale_inv, block=128, out_dtype=np.float32):
    """W[i, j] = fp8[i, j] * scale_inv[i // block, j // block] (edge blocks may be partial).

    The product of a 4-bit fp8 significand and a 24-bit fp32 scale is exact in float64; in
    float32 it is rounded once (which is what an fp32 decode-in-register kernel does).
    """
    u8 = np.asarray(u8, dtype=np.uint8)
    rows, cols = u8.shape
    sb = np.asarray(scale_inv, dtype=np.float32)
    want = (-(-rows // block), -(-cols // block))
    if sb.shape != want:
        raise ValueError("FP8 weight [%d, %d] needs weight_scale_inv %s, got %s"
                         % (rows, cols, want, sb.shape))
    s = np.repeat(np.repeat(sb.astype(out_dtype), block, axis=0)[:rows], block, axis=1)[:, :cols]
    return decode_fp8_e4m3(u8, out_dtype) * s


# --------------------------------------------------------------------------------------------
# Safetensors
# --------------------------------------------------------------------------------------------

# safetensors dtype -> (numpy storage dtype, bytes per element). BF16 and F8 are kept as raw
# integers and decoded explicitly.
_ST_DTYPES = {
    "BF16": (np.dtype("<u2"), 2),
    "F16": (np.dtype("<u2"), 2),
    "F32": (np.dtype("<f4"), 4),
    "F64": (np.dtype("<f8"), 8),
    "U8": (np.dtype("u1"), 1),
    "I8": (np.dtype("i1"), 1),
    "F8_E4M3": (np.dtype("u1"), 1),
}


@dataclasses.dataclass
class TensorInfo:
    name: str
    path: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int  # absolute file offset of the data
    nbytes: int


class SafetensorsReader:
    """Reads tensors of a (possibly sharded) safetensors checkpoint through numpy memmaps.

    Only headers are parsed up front; tensor bytes are touched when a tensor is used, so a
    layer's few tensors are read out of a multi-GB shard without loading the rest.
    """

    def __init__(self, directory):
        self.directory = directory
        self._weight_map: Dict[str, str] = {}  # tensor name -> file name
        self._headers: Dict[str, Dict[str, TensorInfo]] = {}  # file name -> its tensors
        self._maps: Dict[str, np.memmap] = {}
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self._weight_map = dict(json.load(f)["weight_map"])
        else:
            files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
            if not files:
                raise FileNotFoundError("no *.safetensors in %s" % directory)
            for path in files:
                fname = os.path.basename(path)
                for name in self._header(fname):
                    self._weight_map[name] = fname

    def _header(self, fname):
        if fname not in self._headers:
            path = os.path.join(self.directory, fname)
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(hlen))
            data_start = 8 + hlen
            size = os.path.getsize(path)
            infos = {}
            for name, h in header.items():
                if name == "__metadata__":
                    continue
                if h["dtype"] not in _ST_DTYPES:
                    # Unknown dtypes are fine as long as nobody asks for them.
                    infos[name] = TensorInfo(name, path, h["dtype"], tuple(h["shape"]), -1, 0)
                    continue
                begin, end = h["data_offsets"]
                shape = tuple(int(d) for d in h["shape"])
                want = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[h["dtype"]][1]
                if end - begin != want or data_start + end > size:
                    raise ValueError("%s: tensor %s has inconsistent offsets" % (path, name))
                infos[name] = TensorInfo(name, path, h["dtype"], shape, data_start + begin,
                                         end - begin)
            self._headers[fname] = infos
        return self._headers[fname]

    def has(self, name):
        return name in self._weight_map

    def info(self, name) -> TensorInfo:
        if name not in self._weight_map:
            raise KeyError("tensor %s not in checkpoint %s" % (name, self.directory))
        infos = self._header(self._weight_map[name])
        if name not in infos:
            raise KeyError("tensor %s is listed in the index but not in %s"
                           % (name, self._weight_map[name]))
        return infos[name]

    def raw(self, name):
        """The stored array (BF16/F16 as uint16, F8 as uint8), memory-mapped, read-only."""
        info = self.info(name)
        if info.dtype not in _ST_DTYPES:
            raise ValueError("tensor %s has unsupported dtype %s" % (name, info.dtype))
        mm = self._maps.get(info.path)
        if mm is None:
            mm = np.memmap(info.path, dtype=np.uint8, mode="r")
            self._maps[info.path] = mm
        np_dtype = _ST_DTYPES[info.dtype][0]
        return mm[info.offset:info.offset + info.nbytes].view(np_dtype).reshape(info.shape)

    def dense(self, name, out_dtype=np.float32):
        """A tensor stored as BF16/F16/F32/F64, decoded to `out_dtype`."""
        info = self.info(name)
        raw = self.raw(name)
        if info.dtype == "BF16":
            return decode_bf16(raw).astype(out_dtype, copy=False)
        if info.dtype == "F16":
            return decode_f16(raw).astype(out_dtype, copy=False)
        if info.dtype in ("F32", "F64"):
            return raw.astype(out_dtype)  # a copy: the memmap is read-only
        raise ValueError("tensor %s: dtype %s is not a plain float tensor" % (name, info.dtype))

    def matrix(self, base, out_dtype=np.float32):
        """The linear layer `base` (a name without .weight) as a dense [out, in] matrix.

        The stored format is recognised by the tensors present: `.weight_packed` +
        `.weight_scale` (MXFP4), `.weight` F8_E4M3 + `.weight_scale_inv` (FP8 block-128), or a
        plain `.weight` (BF16/F16/F32).
        """
        if self.has(base + ".weight_packed"):
            return decode_mxfp4(self.raw(base + ".weight_packed"),
                                self.raw(base + ".weight_scale"), out_dtype)
        if not self.has(base + ".weight"):
            raise KeyError("no %s.weight or %s.weight_packed in checkpoint %s"
                           % (base, base, self.directory))
        info = self.info(base + ".weight")
        if info.dtype == "F8_E4M3":
            if not self.has(base + ".weight_scale_inv"):
                raise KeyError("FP8 tensor %s.weight has no %s.weight_scale_inv" % (base, base))
            return dequant_fp8_block(self.raw(base + ".weight"),
                                     self.dense(base + ".weight_scale_inv", np.float32),
                                     out_dtype=out_dtype)
        w = self.dense(base + ".weight", out_dtype)
        if w.ndim != 2:
            raise ValueError("%s.weight is not a matrix: shape %s" % (base, w.shape))
        return w


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MoeConfig:
    family: str              # "k3" (kimi_k3 / kimi_linear) or "k2" (kimi_k2 / deepseek_v3)
    model_type: str
    hidden_size: int
    num_experts: int
    top_k: int
    expert_hidden: int       # moe_intermediate_size
    latent_size: Optional[int]  # routed_expert_hidden_size; None: experts see the hidden width
    num_shared: int          # shared MLP width = num_shared * expert_hidden (0: none)
    latent_norm: bool
    renormalize: bool
    scaling: float
    rms_eps: float
    activation: str          # "situ" or "silu"
    situ_beta: float
    situ_linear_beta: float
    n_group: int
    topk_group: int

    @property
    def expert_input(self):
        return self.latent_size if self.latent_size else self.hidden_size

    @property
    def grouped(self):
        # As in the seed gates: groups only matter when some are actually dropped.
        return self.n_group > 1 and self.topk_group < self.n_group


def parse_config(j):
    """MoeConfig from a parsed config.json (see docs/DESIGN.md "Checkpoints")."""
    model_type = j.get("model_type", "")
    if model_type in ("kimi_k3", "kimi_linear"):
        # kimi_k3 nests the text model's fields; kimi_linear is flat.
        c = j["text_config"] if isinstance(j.get("text_config"), dict) else j

        def get(key, default=None, required=False):
            if required and c.get(key) is None:
                raise ValueError("config.json: missing %s" % key)
            v = c.get(key)
            return default if v is None else v

        if get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("config.json: moe_router_activation_func %r is not supported"
                             % c["moe_router_activation_func"])
        cfg = MoeConfig(
            family="k3", model_type=model_type,
            hidden_size=int(get("hidden_size", required=True)),
            num_experts=int(get("num_experts", required=True)),
            top_k=int(get("num_experts_per_token", required=True)),
            expert_hidden=int(get("moe_intermediate_size", required=True)),
            latent_size=(int(c["routed_expert_hidden_size"])
                         if c.get("routed_expert_hidden_size") else None),
            num_shared=int(get("num_shared_experts", 0)),
            latent_norm=bool(get("latent_moe_use_norm", False)),
            renormalize=bool(get("moe_renormalize", True)),
            scaling=float(get("routed_scaling_factor", 1.0)),
            rms_eps=float(get("rms_norm_eps", 1e-6)),
            activation=str(get("hidden_act", "situ")),
            situ_beta=float(get("activation_situ_beta", 4.0)),
            situ_linear_beta=float(get("activation_situ_linear_beta", 25.0)),
            n_group=int(get("num_expert_group", 1)),
            topk_group=int(get("topk_group", 1)),
        )
    elif model_type in ("kimi_k2", "deepseek_v3"):
        c = j["text_config"] if isinstance(j.get("text_config"), dict) else j

        def get(key, default=None, required=False):
            if required and c.get(key) is None:
                raise ValueError("config.json: missing %s" % key)
            v = c.get(key)
            return default if v is None else v

        if get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("config.json: scoring_func %r is not supported" % c["scoring_func"])
        cfg = MoeConfig(
            family="k2", model_type=model_type,
            hidden_size=int(get("hidden_size", required=True)),
            num_experts=int(get("n_routed_experts", required=True)),
            top_k=int(get("num_experts_per_tok", required=True)),
            expert_hidden=int(get("moe_intermediate_size", required=True)),
            latent_size=None,
            num_shared=int(get("n_shared_experts", 0)),
            latent_norm=False,
            renormalize=bool(get("norm_topk_prob", True)),
            scaling=float(get("routed_scaling_factor", 1.0)),
            rms_eps=float(get("rms_norm_eps", 1e-6)),
            activation=str(get("hidden_act", "silu")),
            situ_beta=4.0, situ_linear_beta=25.0,
            n_group=int(get("n_group", 1)),
            topk_group=int(get("topk_group", 1)),
        )
    else:
        raise ValueError("config.json: model_type %r is not supported" % model_type)
    if cfg.activation not in ("situ", "silu"):
        raise ValueError("config.json: hidden_act %r is not supported" % cfg.activation)
    if not 1 <= cfg.top_k <= cfg.num_experts:
        raise ValueError("config.json: top-k %d with %d experts" % (cfg.top_k, cfg.num_experts))
    if cfg.grouped:
        if cfg.num_experts % cfg.n_group or cfg.num_experts // cfg.n_group < 2:
            raise ValueError("config.json: %d experts cannot form %d groups of >= 2"
                             % (cfg.num_experts, cfg.n_group))
        if cfg.top_k > cfg.topk_group * (cfg.num_experts // cfg.n_group):
            raise ValueError("config.json: top-k exceeds the experts of the kept groups")
    return cfg


def load_config(directory):
    with open(os.path.join(directory, "config.json")) as f:
        return parse_config(json.load(f))


# --------------------------------------------------------------------------------------------
# Layer weights (tensor names per docs/DESIGN.md "Checkpoints")
# --------------------------------------------------------------------------------------------


class LayerWeights:
    """Names and loaders of one MoE layer's tensors; decodes on demand, caches nothing big."""

    def __init__(self, reader: SafetensorsReader, cfg: MoeConfig, layer: int):
        self.reader, self.cfg, self.layer = reader, cfg, layer
        if cfg.family == "k3":
            candidates = ["language_model.model.layers.%d.block_sparse_moe." % layer,
                          "model.layers.%d.block_sparse_moe." % layer]
            self.expert_names = ("w1", "w3", "w2")  # gate, up, down
        else:
            candidates = ["model.layers.%d.mlp." % layer]
            self.expert_names = ("gate_proj", "up_proj", "down_proj")
        for p in candidates:
            if reader.has(p + "gate.weight"):
                self.prefix = p
                break
        else:
            raise KeyError("layer %d not found: no %s" % (layer, " or ".join(
                p + "gate.weight" for p in candidates)))

    def name(self, suffix):
        return self.prefix + suffix

    def router(self, dtype):
        """(W_gate [E, H], selection bias [E]); the bias is zero when absent."""
        w = self.reader.matrix(self.name("gate"), dtype)
        if w.shape != (self.cfg.num_experts, self.cfg.hidden_size):
            raise ValueError("%s: shape %s, expected %s" % (self.name("gate.weight"), w.shape,
                             (self.cfg.num_experts, self.cfg.hidden_size)))
        bname = self.name("gate.e_score_correction_bias")
        bias = (self.reader.dense(bname, dtype) if self.reader.has(bname)
                else np.zeros(self.cfg.num_experts, dtype))
        return w, bias.reshape(-1)

    def latent_down(self, dtype):
        return self.reader.matrix(self.name("routed_expert_down_proj"), dtype)

    def latent_up(self, dtype):
        return self.reader.matrix(self.name("routed_expert_up_proj"), dtype)

    def latent_norm(self, dtype):
        return self.reader.dense(self.name("routed_expert_norm.weight"), dtype).reshape(-1)

    def expert(self, e, dtype):
        """(gate, up, down) matrices of routed expert e."""
        return tuple(self.reader.matrix(self.name("experts.%d.%s" % (e, n)), dtype)
                     for n in self.expert_names)

    def shared(self, dtype):
        return tuple(self.reader.matrix(self.name("shared_experts.%s" % n), dtype)
                     for n in ("gate_proj", "up_proj", "down_proj"))


# --------------------------------------------------------------------------------------------
# Arithmetic helpers
# --------------------------------------------------------------------------------------------

_DTYPES = {"float64": np.float64, "float32": np.float32}


def _linear(x, w):
    """x [M, K] @ w[N, K]^T in x's precision (fp32 accumulation for float32)."""
    if x.dtype == np.float64:
        return x @ w.astype(np.float64, copy=False).T
    # The system BLAS here is the slow reference one; oneDNN through torch does fp32 GEMMs with
    # fp32 accumulation about 40x faster, which is what makes full-width configs practical.
    try:
        import torch
        if x.shape[0] == 0:
            return np.zeros((0, w.shape[0]), np.float32)
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to_mkldnn()
        wt = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to_mkldnn()
        return torch._C._nn.mkldnn_linear(xt, wt, None).to_dense().numpy()
    except (ImportError, AttributeError, RuntimeError):
        return x @ w.astype(np.float32, copy=False).T


def _sigmoid(z):
    # Written so that exp never overflows.
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(z.dtype, copy=False)


def _activation(cfg, g, u):
    """GLU activation of gate g and up u, in their (compute) precision."""
    if cfg.activation == "situ":
        b, lb = cfg.situ_beta, cfg.situ_linear_beta
        return (b * np.tanh(g / b) * _sigmoid(g)) * (lb * np.tanh(u / lb))
    return g * _sigmoid(g) * u  # silu(g) * u


class _Rounding:
    """Where the contract rounds: bf16 mode rounds to bf16, fp32 mode is the identity."""

    def __init__(self, mode):
        if mode not in ("bf16", "fp32"):
            raise ValueError("dtype must be bf16 or fp32, got %r" % mode)
        self.mode = mode

    def __call__(self, a):
        return round_bf16(a) if self.mode == "bf16" else a

    def weights(self, w):
        """Router weights are carried in fp32 in bf16 mode."""
        return w.astype(np.float32).astype(w.dtype) if self.mode == "bf16" else w


def _mlp(cfg, x, gate, up, down, R):
    """One GLU MLP (routed expert or shared experts) with the contract's roundings."""
    g = R(_linear(x, gate))
    u = R(_linear(x, up))
    a = R(_activation(cfg, g, u))
    return R(_linear(a, down))


# --------------------------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------------------------


def _ranked(scores):
    """Column order per row by descending score, ties toward the lower index.

    A stable sort of the negated scores keeps equal scores in index order, which is exactly
    "lower expert index wins".
    """
    return np.argsort(-scores, axis=1, kind="stable")


def select_experts(biased, top_k, n_group=1, topk_group=1, near_tie_margin=0.0):
    """Top-k of the biased scores [T, E], DeepSeek group-limited when n_group > topk_group > 0.

    Returns (ids [T, k] int64 in descending biased-score order, near_tie [T] bool). A token is
    near a tie when the k-th and (k+1)-th eligible biased scores, or (with groups) the
    topk_group-th and next group scores, are closer than near_tie_margin.
    """
    biased = np.asarray(biased)
    T, E = biased.shape
    near = np.zeros(T, dtype=bool)
    rows = np.arange(T)[:, None]
    eligible = biased
    if n_group > 1 and topk_group < n_group:
        per = E // n_group
        grouped = biased.reshape(T, n_group, per)
        # Group score: sum of the two best biased scores in the group (seed gates).
        top2 = -np.sort(-grouped, axis=2)[:, :, :2]
        gscore = top2[:, :, 0] + top2[:, :, 1]
        gorder = _ranked(gscore)
        gsorted = gscore[rows, gorder]
        near |= (gsorted[:, topk_group - 1] - gsorted[:, topk_group]) < near_tie_margin
        keep = np.zeros((T, n_group), dtype=bool)
        keep[rows, gorder[:, :topk_group]] = True
        eligible = np.where(np.repeat(keep, per, axis=1), biased, -np.inf)
        n_eligible = topk_group * per
    else:
        n_eligible = E
    order = _ranked(eligible)
    ids = order[:, :top_k]
    if top_k < n_eligible:
        ssorted = eligible[rows, order[:, :top_k + 1]]
        near |= (ssorted[:, top_k - 1] - ssorted[:, top_k]) < near_tie_margin
    return ids, near


def route(x, gate_w, bias, cfg: MoeConfig, R=None, near_tie_margin=0.0):
    """Router: (ids [T, k], weights [T, k], near_tie [T]).

    s = sigmoid(x W_gate^T) in the compute precision of x; selection on s + bias; weights
    from the unbiased s, renormalized over the selection (as the seed gates, only for k > 1)
    then scaled by routed_scaling_factor; in bf16 mode the weights are rounded to fp32.
    """
    s = _sigmoid(_linear(x, gate_w))
    biased = s + bias.astype(s.dtype)[None, :]
    ids, near = select_experts(biased, cfg.top_k, cfg.n_group if cfg.grouped else 1,
                               cfg.topk_group, near_tie_margin)
    w = np.take_along_axis(s, ids, axis=1)
    if cfg.renormalize and cfg.top_k > 1:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    w = w * cfg.scaling
    if R is not None:
        w = R.weights(w)
    return ids, w, near


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LayerResult:
    out: np.ndarray          # [..., H] float32, the input's shape
    expert_ids: np.ndarray   # [..., k] int32, descending biased score
    weights: np.ndarray      # [..., k] float32, same order
    near_tie: np.ndarray     # [...] bool


def _routed_experts(cfg, weights: LayerWeights, h, ids, w, R, dtype):
    """y = sum_k w_k E_{ids_k}(h): tokens sorted by expert, each expert run once on all its
    tokens, outputs scattered back into (token, slot) order (the seed's moe_infer)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
    counts = np.bincount(flat, minlength=cfg.num_experts)
    starts = np.concatenate([[0], np.cumsum(counts)])
    used = [int(e) for e in np.nonzero(counts)[0]]
    outs = np.empty((T * k, h.shape[1]), dtype=dtype)
    # Each used expert is decoded once; the next one is decoded on a helper thread while this
    # one's GEMMs run (numpy and oneDNN both release the GIL).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(weights.expert, used[0], dtype) if used else None
        for i, e in enumerate(used):
            gate, up, down = pending.result()
            if i + 1 < len(used):
                pending = pool.submit(weights.expert, used[i + 1], dtype)
            pairs = order[starts[e]:starts[e + 1]]
            outs[pairs] = _mlp(cfg, h[pairs // k], gate, up, down, R)
            del gate, up, down
    # Combine: fp32 (here: compute precision) accumulation of the weighted expert outputs.
    return (outs.reshape(T, k, -1) * w[:, :, None]).sum(axis=1)


def moe_layer_forward(checkpoint, layer, x, dtype="bf16", compute="float64",
                      near_tie_margin=1e-4, config: Optional[MoeConfig] = None,
                      out_dtype=np.float32):
    """The MoE layer `layer` of the checkpoint directory on input x [T, H] or [B, T, H].

    dtype: "bf16" (the contract's rounding) or "fp32" (no rounding); compute: "float64" or
    "float32" precision of all arithmetic; out_dtype None keeps the output in the compute
    precision (for exactness checks). Returns a LayerResult.
    """
    reader = checkpoint if isinstance(checkpoint, SafetensorsReader) else \
        SafetensorsReader(checkpoint)
    cfg = config or load_config(reader.directory)
    weights = LayerWeights(reader, cfg, layer)
    cd = _DTYPES[compute]
    R = _Rounding(dtype)

    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16):
        raise TypeError("input must be float32 or float16, got %s" % x.dtype)
    if x.ndim not in (2, 3) or x.shape[-1] != cfg.hidden_size:
        raise ValueError("input shape %s, expected [T, %d] or [B, T, %d]"
                         % (x.shape, cfg.hidden_size, cfg.hidden_size))
    lead = x.shape[:-1]
    # fp16 and fp32 inputs are exact in float32/float64; bf16 mode starts from bf16(x).
    xt = R(x.reshape(-1, cfg.hidden_size).astype(np.float32).astype(cd))

    # (1) router, on the full-width input
    gate_w, bias = weights.router(cd)
    ids, w, near = route(xt, gate_w, bias, cfg, R, near_tie_margin)

    # (2) latent down-projection (K3); K2 experts see x itself
    h = R(_linear(xt, weights.latent_down(cd))) if cfg.latent_size else xt

    # (3), (4) routed experts and their weighted sum
    y = R(_routed_experts(cfg, weights, h, ids, w, R, cd))

    # (5) latent RMSNorm and up-projection (K3)
    if cfg.latent_size:
        if cfg.latent_norm:
            inv_rms = 1.0 / np.sqrt(np.mean(y * y, axis=1, keepdims=True) + cfg.rms_eps)
            y = R(R(y * inv_rms) * weights.latent_norm(cd)[None, :])
        r = R(_linear(y, weights.latent_up(cd)))
    else:
        r = y

    # (6) shared experts on the full-width input
    if cfg.num_shared:
        shared = _mlp(cfg, xt, *weights.shared(cd), R)
        out = R(r + shared)
    else:
        out = r

    k = cfg.top_k
    return LayerResult(
        out=(out if out_dtype is None else out.astype(out_dtype)).reshape(x.shape),
        expert_ids=ids.astype(np.int32).reshape(lead + (k,)),
        weights=w.astype(np.float32).reshape(lead + (k,)),
        near_tie=near.reshape(lead),
    )


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json)")
    p.add_argument("--layer", required=True, type=int, help="layer index (checkpoint numbering)")
    p.add_argument("--input", required=True, help=".npy float32/float16 [T, H] or [B, T, H]")
    p.add_argument("--output", required=True, help=".npy float32, the input's shape")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--compute", default="float64", choices=["float64", "float32"],
                   help="precision of all arithmetic (float32 for large configs)")
    p.add_argument("--experts-out", help=".npy int32 [..., k] selected experts")
    p.add_argument("--weights-out", help=".npy float32 [..., k] combine weights")
    p.add_argument("--near-tie-out", help=".npy uint8 [...] 1 = token with fragile selection")
    p.add_argument("--near-tie-margin", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads for the float32 GEMMs (torch/oneDNN)")
    args = p.parse_args(argv)

    if args.compute == "float32":
        try:
            import torch
            torch.set_num_threads(max(1, args.threads))
        except ImportError:
            pass
    x = np.load(args.input)
    res = moe_layer_forward(args.checkpoint, args.layer, x, dtype=args.dtype,
                            compute=args.compute, near_tie_margin=args.near_tie_margin)
    np.save(args.output, res.out)
    if args.experts_out:
        np.save(args.experts_out, res.expert_ids)
    if args.weights_out:
        np.save(args.weights_out, res.weights)
    if args.near_tie_out:
        # uint8 0/1 rather than numpy bool: the most widely readable .npy mask.
        np.save(args.near_tie_out, res.near_tie.astype(np.uint8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
