#!/usr/bin/python3
"""Self-checks of the Python MoE reference (moe_reference.py).

  /usr/bin/python3 -m unittest discover -s tests/reference

The checkpoints here come from a small writer in this file (not the C++ generator): BF16, MXFP4
and FP8 tensors, sharded with an index, K3 and K2 names. Encoders and expected values are written
independently of the reference's decoders (bit-level definitions, torch's bf16 conversion).

MOE_REF_FULL=1 also runs the full-width K3 timing check (writes ~1 GB to a temp dir).
"""

import fractions
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_inputs  # noqa: E402
import moe_reference as ref  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3"

# --------------------------------------------------------------------------------------------
# Independent encoders and format definitions
# --------------------------------------------------------------------------------------------


def bf16_bits(a):
    """fp32 -> bf16 bits with torch's (round-to-nearest-even) conversion."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def e2m1_value(code):
    """E2M1 from its bit fields: 1 sign, 2 exponent (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    if exp == 0:
        return sign * man * 0.5  # subnormal: 0.m * 2^(1-1)
    return sign * math.ldexp(1.0 + man / 2.0, exp - 1)


def e4m3_value(code):
    """FP8 e4m3fn from its bit fields, via exact rational arithmetic."""
    sign = -1 if code & 0x80 else 1
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        v = fractions.Fraction(man, 8) * fractions.Fraction(1, 2 ** 6)
    else:
        v = (1 + fractions.Fraction(man, 8)) * fractions.Fraction(2) ** (exp - 7)
    return float(sign * v) if v != 0 else math.copysign(0.0, sign)


E4M3_FINITE = sorted({e4m3_value(c) for c in range(256) if not math.isnan(e4m3_value(c))})


def fp8_encode_nearest(x):
    """fp32 values -> e4m3 codes of the nearest finite value (saturating); test data only."""
    table = np.array([e4m3_value(c) for c in range(256)])
    finite = np.array([c for c in range(256) if not math.isnan(table[c])])
    vals = table[finite]
    idx = np.argmin(np.abs(x.reshape(-1, 1) - vals[None, :]), axis=1)
    return finite[idx].astype(np.uint8).reshape(x.shape)


def write_safetensors(path, tensors):
    """tensors: name -> (safetensors dtype, numpy array holding the stored bytes)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    hjson = json.dumps(header).encode()
    hjson += b" " * (-len(hjson) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)


def write_checkpoint(directory, config, tensors, shards=1):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    names = list(tensors)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        return
    weight_map = {}
    for i in range(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, shards)
        part = names[i::shards]  # interleaved, so one expert's tensors span files
        write_safetensors(os.path.join(directory, fname), {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


class TensorFactory:
    """Random layer tensors in the checkpoint formats, variance ~ 1/fan_in."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def bf16(self, shape, std=None):
        std = std if std is not None else 1.0 / math.sqrt(shape[-1])
        return ("BF16", bf16_bits(self.rng.standard_normal(shape).astype(np.float32) * std))

    def f32(self, shape, std):
        return ("F32", (self.rng.standard_normal(shape) * std).astype(np.float32))

    def mxfp4(self, out, inp):
        packed = self.rng.integers(0, 256, size=(out, inp // 2), dtype=np.uint8)
        # Uniform E2M1 codes have rms ~2.9; pick exponents so rows have rms ~ 1/sqrt(in).
        center = 127 - round(math.log2(2.93 * math.sqrt(inp)))
        scales = self.rng.integers(center - 1, center + 2, size=(out, inp // 32), dtype=np.uint8)
        return {"weight_packed": ("U8", packed), "weight_scale": ("U8", scales)}

    def fp8(self, out, inp):
        codes = fp8_encode_nearest(self.rng.standard_normal((out, inp)) * 4.0)
        sblocks = (-(-out // 128), -(-inp // 128))
        # Deliberately not powers of two: real K2 scales are amax / 448.
        scale_inv = (self.rng.uniform(0.5, 1.5, sblocks) / (4.0 * math.sqrt(inp)))
        return {"weight": ("F8_E4M3", codes), "weight_scale_inv": ("F32",
                                                                   scale_inv.astype(np.float32))}

    def matrix(self, fmt, out, inp):
        if fmt == "bf16":
            return {"weight": self.bf16((out, inp))}
        if fmt == "mxfp4":
            return self.mxfp4(out, inp)
        if fmt == "fp8":
            return self.fp8(out, inp)
        raise ValueError(fmt)


def add_matrix(tensors, base, parts):
    for suffix, t in parts.items():
        tensors[base + "." + suffix] = t


def make_k3(directory, layer=3, H=128, Lat=64, I=96, E=16, k=4, shared=2, expert_fmt="mxfp4",
            norm=True, nested=True, lm_prefix=True, shards=3, seed=1, latent=True,
            extra_cfg=None):
    f = TensorFactory(seed)
    text = {"model_type": "kimi_linear", "hidden_size": H, "num_experts": E,
            "num_experts_per_token": k, "moe_intermediate_size": I,
            "num_shared_experts": shared, "latent_moe_use_norm": norm, "moe_renormalize": True,
            "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1}
    if latent:
        text["routed_expert_hidden_size"] = Lat
    text.update(extra_cfg or {})
    config = {"model_type": "kimi_k3", "text_config": text} if nested else text
    pre = ("language_model." if lm_prefix else "") + "model.layers.%d.block_sparse_moe." % layer
    D = Lat if latent else H
    t = {pre + "gate.weight": f.bf16((E, H)),
         pre + "gate.e_score_correction_bias": f.f32((E,), 0.05)}
    if latent:
        t[pre + "routed_expert_down_proj.weight"] = f.bf16((Lat, H))
        t[pre + "routed_expert_up_proj.weight"] = f.bf16((H, Lat))
        if norm:
            t[pre + "routed_expert_norm.weight"] = (
                "BF16", bf16_bits(1.0 + 0.2 * f.rng.standard_normal(Lat).astype(np.float32)))
    for e in range(E):
        add_matrix(t, pre + "experts.%d.w1" % e, f.matrix(expert_fmt, I, D))
        add_matrix(t, pre + "experts.%d.w3" % e, f.matrix(expert_fmt, I, D))
        add_matrix(t, pre + "experts.%d.w2" % e, f.matrix(expert_fmt, D, I))
    if shared:
        S = shared * I
        add_matrix(t, pre + "shared_experts.gate_proj", f.matrix("bf16", S, H))
        add_matrix(t, pre + "shared_experts.up_proj", f.matrix("bf16", S, H))
        add_matrix(t, pre + "shared_experts.down_proj", f.matrix("bf16", H, S))
    write_checkpoint(directory, config, t, shards)
    return directory


def make_k2(directory, layer=1, H=192, I=136, E=16, k=4, n_group=4, topk_group=2, shared=1,
            fmt="fp8", shards=2, seed=2):
    """FP8 dims deliberately not multiples of 128: partial edge scale blocks."""
    f = TensorFactory(seed)
    config = {"model_type": "deepseek_v3", "hidden_size": H, "n_routed_experts": E,
              "num_experts_per_tok": k, "moe_intermediate_size": I, "n_shared_experts": shared,
              "routed_scaling_factor": 2.827, "norm_topk_prob": True, "n_group": n_group,
              "topk_group": topk_group, "hidden_act": "silu", "scoring_func": "sigmoid",
              "topk_method": "noaux_tc"}
    pre = "model.layers.%d.mlp." % layer
    t = {pre + "gate.weight": f.bf16((E, H)),
         pre + "gate.e_score_correction_bias": f.f32((E,), 0.05)}
    for e in range(E):
        add_matrix(t, pre + "experts.%d.gate_proj" % e, f.matrix(fmt, I, H))
        add_matrix(t, pre + "experts.%d.up_proj" % e, f.matrix(fmt, I, H))
        add_matrix(t, pre + "experts.%d.down_proj" % e, f.matrix(fmt, H, I))
    if shared:
        S = shared * I
        add_matrix(t, pre + "shared_experts.gate_proj", f.matrix(fmt, S, H))
        add_matrix(t, pre + "shared_experts.up_proj", f.matrix(fmt, S, H))
        add_matrix(t, pre + "shared_experts.down_proj", f.matrix(fmt, H, S))
    write_checkpoint(directory, config, t, shards)
    return directory


# --------------------------------------------------------------------------------------------
# A deliberately naive second implementation: one token at a time, no sorting
# --------------------------------------------------------------------------------------------


def naive_forward(directory, layer, x, mode):
    """Per-token loop in float64 straight from the docs/DESIGN.md "Numerics" formulas."""
    cfg = ref.load_config(directory)
    rd = ref.SafetensorsReader(directory)
    rb = ref.round_bf16 if mode == "bf16" else (lambda v: v)
    f64 = np.float64
    # Tensor names spelled out here again (docs/DESIGN.md "Checkpoints"), not taken from the reference.
    if cfg.family == "k3":
        pre = "language_model.model.layers.%d.block_sparse_moe." % layer
        if not rd.has(pre + "gate.weight"):
            pre = "model.layers.%d.block_sparse_moe." % layer
        expert_names = ("w1", "w3", "w2")
    else:
        pre = "model.layers.%d.mlp." % layer
        expert_names = ("gate_proj", "up_proj", "down_proj")
    gate_w = rd.matrix(pre + "gate", f64)
    bias = rd.dense(pre + "gate.e_score_correction_bias", f64)
    shared = [rd.matrix(pre + "shared_experts." + n, f64) for n in
              ("gate_proj", "up_proj", "down_proj")] if cfg.num_shared else None
    if cfg.latent_size:
        w_down = rd.matrix(pre + "routed_expert_down_proj", f64)
        w_up = rd.matrix(pre + "routed_expert_up_proj", f64)
        if cfg.latent_norm:
            norm_w = rd.dense(pre + "routed_expert_norm.weight", f64)
    experts = {}

    def sig(z):
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-z))

    def act(g, u):
        if cfg.activation == "situ":
            return (cfg.situ_beta * np.tanh(g / cfg.situ_beta) * sig(g)
                    * cfg.situ_linear_beta * np.tanh(u / cfg.situ_linear_beta))
        return g * sig(g) * u

    def mlp(v, mats):
        w1, w3, w2 = mats
        g = rb(w1 @ v)
        u = rb(w3 @ v)
        return rb(w2 @ rb(act(g, u)))

    xs = x.reshape(-1, cfg.hidden_size).astype(f64)
    out = np.zeros_like(xs)
    all_ids, all_w = [], []
    for t in range(xs.shape[0]):
        xt = rb(xs[t])
        s = sig(gate_w @ xt)
        b = s + bias
        candidates = list(range(cfg.num_experts))
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            per = cfg.num_experts // cfg.n_group
            gs = [sum(sorted(b[g * per:(g + 1) * per], reverse=True)[:2])
                  for g in range(cfg.n_group)]
            groups = sorted(range(cfg.n_group), key=lambda g: (-gs[g], g))[:cfg.topk_group]
            candidates = [e for e in candidates if e // per in groups]
        sel = sorted(candidates, key=lambda e: (-b[e], e))[:cfg.top_k]
        w = np.array([s[e] for e in sel])
        if cfg.renormalize and cfg.top_k > 1:
            w = w / (w.sum() + 1e-20)
        w = w * cfg.scaling
        if mode == "bf16":
            w = w.astype(np.float32).astype(f64)
        h = rb(w_down @ xt) if cfg.latent_size else xt
        y = np.zeros(cfg.expert_input)
        for e, we in zip(sel, w):
            if e not in experts:
                experts[e] = [rd.matrix("%sexperts.%d.%s" % (pre, e, n), f64)
                              for n in expert_names]
            y = y + mlp(h, experts[e]) * we
        y = rb(y)
        if cfg.latent_size:
            if cfg.latent_norm:
                y = rb(rb(y / math.sqrt(np.mean(y * y) + cfg.rms_eps)) * norm_w)
            y = rb(w_up @ y)
        if cfg.num_shared:
            y = rb(y + mlp(xt, shared))
        out[t] = y
        all_ids.append(sel)
        all_w.append(w)
    return out.reshape(x.shape), np.array(all_ids), np.array(all_w)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


class NumberFormatTest(unittest.TestCase):

    def test_bf16_round_ties_to_even(self):
        # Halfway cases (low 16 bits 0x8000): round to the even upper half.
        cases = {0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0xBF808000: 0xBF80,
                 0xBF818000: 0xBF82, 0x3F808001: 0x3F81, 0x3F807FFF: 0x3F80,
                 0x7F7FFFFF: 0x7F80, 0x00008000: 0x0000, 0x00018000: 0x0002}
        bits = np.array(list(cases), dtype=np.uint32)
        got = ref.round_bf16(bits.view(np.float32)).view(np.uint32) >> 16
        np.testing.assert_array_equal(got, np.array(list(cases.values()), dtype=np.uint32))
        # The float64 path must agree on the same values.
        got64 = ref.round_bf16(bits.view(np.float32).astype(np.float64)).astype(np.float32)
        np.testing.assert_array_equal(got64.view(np.uint32) >> 16, got)

    def test_bf16_round_matches_torch_on_random_bits(self):
        rng = np.random.default_rng(0)
        bits = rng.integers(0, 2 ** 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
        bits[::7] = (bits[::7] & 0xFFFF0000) | 0x8000  # many exact ties
        x = bits.view(np.float32)
        want = bf16_bits(x)
        got32 = ref.round_bf16(x)
        with np.errstate(invalid="ignore"):  # NaN payloads
            got64 = ref.round_bf16(x.astype(np.float64)).astype(np.float32)
        finite = np.isfinite(x)
        np.testing.assert_array_equal((got32.view(np.uint32) >> 16).astype(np.uint16)[finite],
                                      want[finite])
        np.testing.assert_array_equal(got64.view(np.uint32)[finite], got32.view(np.uint32)[finite])
        self.assertTrue(np.all(np.isnan(got32[np.isnan(x)])))
        self.assertTrue(np.all(np.isnan(got64[np.isnan(x)])))

    def test_bf16_round_float64_is_not_double_rounded(self):
        # 1 + 2^-8 is the midpoint between bf16 1.0 and 1.0078125; just above it, below fp32
        # resolution, must round up (fp64 -> fp32 -> bf16 would land on the tie, go to 1.0).
        v = np.array([1.0 + 2.0 ** -8 + 2.0 ** -40, 1.0 + 2.0 ** -8 - 2.0 ** -40,
                      -(1.0 + 2.0 ** -8 + 2.0 ** -40)])
        np.testing.assert_array_equal(ref.round_bf16(v), [1.0078125, 1.0, -1.0078125])
        # Against exact rational rounding on random doubles across many binades.
        rng = np.random.default_rng(1)
        xs = rng.standard_normal(2000) * np.exp2(rng.integers(-130, 120, 2000))
        got = ref.round_bf16(xs)
        for x, g in zip(xs, got):
            fx = fractions.Fraction(float(x))
            e = max(math.frexp(x)[1], -125)
            q = fractions.Fraction(2) ** (e - 8)
            want = round(fx / q) * q  # Python's round() on a Fraction is half-to-even
            self.assertEqual(fractions.Fraction(float(g)), want, x)

    def test_bf16_decode_all_patterns(self):
        u = np.arange(65536, dtype=np.uint16)
        want = torch.from_numpy(u.view(np.int16)).view(torch.bfloat16).float().numpy()
        got = ref.decode_bf16(u)
        np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)],
                                      want.view(np.uint32)[~np.isnan(want)])
        self.assertTrue(np.all(np.isnan(got[np.isnan(want)])))

    def test_mxfp4_all_nibbles_all_scales(self):
        # Row r uses scale exponent r in every block; its 512 elements are bytes 0..255.
        scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
        packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
        got = ref.decode_mxfp4(packed, scales, out_dtype=np.float64)
        for r in range(256):
            for byte in (0x00, 0x17, 0x8F, 0xF1):
                for half, nib in ((0, byte & 0xF), (1, byte >> 4)):
                    v = got[r, 2 * byte + half]
                    if r == 255:
                        self.assertTrue(math.isnan(v))  # E8M0 0xFF is NaN
                    else:
                        self.assertEqual(v, e2m1_value(nib) * math.ldexp(1.0, r - 127))
        # Every nibble in both positions, every finite scale, vectorized against the definition.
        e2m1 = np.array([e2m1_value(n) for n in range(16)])
        want = np.stack([e2m1[np.arange(256) & 0xF], e2m1[np.arange(256) >> 4]], 1).reshape(-1)
        want = want[None, :] * np.ldexp(1.0, np.arange(255) - 127)[:, None]
        np.testing.assert_array_equal(got[:255], want)
        # float32 decode is exact wherever fp32 can hold the value.
        got32 = ref.decode_mxfp4(packed[:253], scales[:253], out_dtype=np.float32)
        np.testing.assert_array_equal(got32.astype(np.float64), got[:253])
        # Each element uses the scale of its own 32-block.
        rng = np.random.default_rng(3)
        p = rng.integers(0, 256, (5, 48), dtype=np.uint8)
        s = rng.integers(110, 140, (5, 3), dtype=np.uint8)
        d = ref.decode_mxfp4(p, s, np.float64)
        for i in range(5):
            for j in range(96):
                nib = (int(p[i, j // 2]) >> (4 * (j % 2))) & 0xF
                self.assertEqual(d[i, j], e2m1_value(nib) * 2.0 ** (int(s[i, j // 32]) - 127))

    def test_fp8_all_codes(self):
        got = ref.decode_fp8_e4m3(np.arange(256, dtype=np.uint8), np.float64)
        for c in range(256):
            want = e4m3_value(c)
            if math.isnan(want):
                self.assertTrue(math.isnan(got[c]), hex(c))
            else:
                self.assertEqual(got[c], want, hex(c))
                self.assertEqual(math.copysign(1, got[c]), math.copysign(1, want), hex(c))
        self.assertEqual([c for c in range(256) if math.isnan(got[c])], [0x7F, 0xFF])
        spot = {0x00: 0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0,
                0x7E: 448.0, 0xFE: -448.0, 0xB8: -1.0}
        for c, v in spot.items():
            self.assertEqual(got[c], v, hex(c))
        self.assertTrue(np.all(np.diff(got[:0x7F]) > 0))  # positive codes are ordered
        got32 = ref.decode_fp8_e4m3(np.arange(256, dtype=np.uint8), np.float32)
        np.testing.assert_array_equal(got32.astype(np.float64), got)

    def test_fp8_block_scales_with_partial_edges(self):
        rng = np.random.default_rng(4)
        codes = rng.integers(0, 256, (200, 300), dtype=np.uint8)
        codes[codes & 0x7F == 0x7F] = 0x11
        sinv = rng.uniform(0.1, 2.0, (2, 3)).astype(np.float32)
        got = ref.dequant_fp8_block(codes, sinv, out_dtype=np.float64)
        table = np.array([e4m3_value(c) for c in range(256)])
        for bi in range(2):
            for bj in range(3):
                blk = (slice(128 * bi, 128 * bi + 128), slice(128 * bj, 128 * bj + 128))
                np.testing.assert_array_equal(got[blk],
                                              table[codes[blk]] * float(sinv[bi, bj]))
        with self.assertRaises(ValueError):
            ref.dequant_fp8_block(codes, sinv[:1], out_dtype=np.float64)


class CheckpointTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="moe_ref_ckpt_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_reader_sharded_and_dtypes(self):
        d = os.path.join(self.tmp, "dtypes")
        rng = np.random.default_rng(5)
        f32 = rng.standard_normal((3, 5)).astype(np.float32)
        f16 = rng.standard_normal((4, 2)).astype(np.float16)
        tensors = {"a.weight": ("F32", f32), "b.weight": ("F16", f16.view(np.uint16)),
                   "c.weight": ("BF16", bf16_bits(f32)), "d": ("U8", np.arange(7, dtype=np.uint8))}
        write_checkpoint(d, {"model_type": "deepseek_v3"}, tensors, shards=3)
        r = ref.SafetensorsReader(d)
        np.testing.assert_array_equal(r.dense("a.weight"), f32)
        np.testing.assert_array_equal(r.dense("b.weight"), f16.astype(np.float32))
        np.testing.assert_array_equal(r.dense("c.weight"), ref.round_bf16(f32))
        np.testing.assert_array_equal(r.raw("d"), np.arange(7))
        self.assertEqual(r.info("c.weight").shape, (3, 5))
        self.assertFalse(r.has("e"))
        with self.assertRaises(KeyError):
            r.matrix("e")

    def test_config_variants(self):
        nested = {"model_type": "kimi_k3", "text_config": {
            "hidden_size": 640, "num_experts": 64, "num_experts_per_token": 2,
            "moe_intermediate_size": 256, "routed_expert_hidden_size": 320,
            "num_shared_experts": 2, "latent_moe_use_norm": True, "hidden_act": "situ"}}
        c = ref.parse_config(nested)
        self.assertEqual((c.family, c.expert_input, c.num_shared, c.situ_beta,
                          c.situ_linear_beta, c.scaling, c.renormalize),
                         ("k3", 320, 2, 4.0, 25.0, 1.0, True))
        flat = dict(nested["text_config"], model_type="kimi_linear",
                    routed_expert_hidden_size=None, activation_situ_beta=2.0)
        c = ref.parse_config(flat)
        self.assertEqual((c.latent_size, c.expert_input, c.situ_beta), (None, 640, 2.0))
        k2 = {"model_type": "kimi_k2", "hidden_size": 7168, "n_routed_experts": 384,
              "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
              "routed_scaling_factor": 2.827, "norm_topk_prob": True, "n_group": 1,
              "topk_group": 1, "hidden_act": "silu"}
        c = ref.parse_config(k2)
        self.assertEqual((c.family, c.num_experts, c.top_k, c.scaling, c.grouped),
                         ("k2", 384, 8, 2.827, False))
        with self.assertRaises(ValueError):
            ref.parse_config(dict(k2, scoring_func="softmax"))
        with self.assertRaises(ValueError):
            ref.parse_config(dict(k2, model_type="llama"))

    def test_missing_layer_is_reported(self):
        d = make_k3(os.path.join(self.tmp, "k3_missing"), E=4, k=2, shards=1)
        x = make_inputs.make_input((2, 128), seed=1)
        with self.assertRaisesRegex(KeyError, "layer 7 not found"):
            ref.moe_layer_forward(d, 7, x)


class RoutingTest(unittest.TestCase):

    def test_exact_ties_go_to_lower_index(self):
        b = np.array([[0.5, 0.7, 0.7, 0.1, 0.7, 0.7],
                      [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],
                      [0.9, 0.2, 0.9, 0.9, 0.1, 0.0]])
        ids, near = ref.select_experts(b, 3, near_tie_margin=1e-4)
        np.testing.assert_array_equal(ids, [[1, 2, 4], [0, 1, 2], [0, 2, 3]])
        # A tie across the k boundary is fragile; one inside the selection is not.
        np.testing.assert_array_equal(near, [True, True, False])

    def test_group_limited_hand_made(self):
        # 4 groups of 2 (biased scores). Group scores (sum of top 2): 1.0, 1.5, 0.9375, 1.0.
        # Keep 2 groups: group 1, then group 0 (tied with group 3; the lower index wins).
        # Plain top-2 would be [0, 4]; group-limited is [0, 2] (2 and 3 tie at 0.75).
        b = np.array([[1.0, 0.0, 0.75, 0.75, 0.875, 0.0625, 0.5, 0.5]])
        ids, near = ref.select_experts(b, 2, n_group=4, topk_group=2, near_tie_margin=1e-4)
        np.testing.assert_array_equal(ids, [[0, 2]])
        self.assertTrue(near[0])  # groups 0 and 3 tie at the cut
        ids, _ = ref.select_experts(b, 2)
        np.testing.assert_array_equal(ids, [[0, 4]])
        ids, near = ref.select_experts(b, 3, n_group=4, topk_group=2, near_tie_margin=1e-4)
        np.testing.assert_array_equal(ids, [[0, 2, 3]])
        # Well separated groups and experts: not fragile.
        b2 = np.array([[0.1, 0.2, 0.9, 0.8, 0.3, 0.35, 0.6, 0.4]])
        ids, near = ref.select_experts(b2, 2, n_group=4, topk_group=2, near_tie_margin=1e-4)
        np.testing.assert_array_equal(ids, [[2, 3]])
        self.assertFalse(near[0])
        # Through route(): logits 0 give s = 0.5 exactly; the bias makes the scores above.
        cfg = ref.parse_config({"model_type": "deepseek_v3", "hidden_size": 4,
                                "n_routed_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 8, "n_group": 4, "topk_group": 2,
                                "routed_scaling_factor": 2.5})
        x = np.ones((1, 4))
        ids, w, near = ref.route(x, np.zeros((8, 4)), b[0] - 0.5, cfg, near_tie_margin=1e-4)
        np.testing.assert_array_equal(ids, [[0, 2]])
        np.testing.assert_allclose(w, [[1.25, 1.25]], rtol=1e-15)

    def test_weights_are_fp32_in_bf16_mode(self):
        cfg = ref.parse_config({"model_type": "kimi_k2", "hidden_size": 16,
                                "n_routed_experts": 8, "num_experts_per_tok": 3,
                                "moe_intermediate_size": 8, "routed_scaling_factor": 2.827})
        rng = np.random.default_rng(6)
        x, gw, b = rng.standard_normal((50, 16)), rng.standard_normal((8, 16)), np.zeros(8)
        _, w, _ = ref.route(x, gw, b, cfg, ref._Rounding("bf16"))
        np.testing.assert_array_equal(w.astype(np.float32).astype(np.float64), w)
        _, w, _ = ref.route(x, gw, b, cfg, ref._Rounding("fp32"))
        self.assertFalse(np.array_equal(w.astype(np.float32).astype(np.float64), w))
        np.testing.assert_allclose(w.sum(axis=1), 2.827, rtol=1e-14)

    def test_layer_ties_from_identical_gate_rows(self):
        # Experts 3, 7 and 11 have identical router rows aligned with the token, so their
        # scores tie exactly (and the bias is zero); top-2 must be [3, 7].
        tmp = tempfile.mkdtemp(prefix="moe_ref_tie_")
        try:
            d = make_k3(os.path.join(tmp, "k3"), E=16, k=2, shards=1)
            x = make_inputs.make_input((3, 128), seed=7)
            xb = ref.round_bf16(x)
            r = ref.SafetensorsReader(d)
            pre = "language_model.model.layers.3.block_sparse_moe."
            tensors = {n: (r.info(n).dtype, np.array(r.raw(n))) for n in r._weight_map}
            del r
            gate = ref.decode_bf16(tensors[pre + "gate.weight"][1]) * 0.01
            for e in (3, 7, 11):
                gate[e] = xb.sum(axis=0) / 8.0
            tensors[pre + "gate.weight"] = ("BF16", bf16_bits(gate))
            tensors[pre + "gate.e_score_correction_bias"] = ("F32", np.zeros(16, np.float32))
            write_safetensors(os.path.join(d, "model.safetensors"), tensors)
            for mode in ("bf16", "fp32"):
                res = ref.moe_layer_forward(d, 3, xb, dtype=mode)
                np.testing.assert_array_equal(res.expert_ids, [[3, 7]] * 3)
                np.testing.assert_array_equal(res.weights, [[0.5, 0.5]] * 3)
                self.assertTrue(np.all(res.near_tie))
                _, nids, _ = naive_forward(d, 3, xb, mode)
                np.testing.assert_array_equal(nids, [[3, 7]] * 3)
        finally:
            shutil.rmtree(tmp)


class LayerTest(unittest.TestCase):
    """The layer against the naive per-token implementation, on every checkpoint flavour."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="moe_ref_layer_")
        cls.ckpts = {
            # K3: nested config, language_model. prefix, MXFP4 experts, 3 shards with an index.
            "k3_mxfp4": (make_k3(os.path.join(cls.tmp, "k3_mxfp4")), 3),
            # K3: flat kimi_linear, model. prefix, bf16 experts, latent without norm, no shared.
            "k3_flat": (make_k3(os.path.join(cls.tmp, "k3_flat"), layer=5, expert_fmt="bf16",
                                norm=False, nested=False, lm_prefix=False, shards=1, shared=0,
                                seed=11), 5),
            # K3 without a latent, grouped routing, scaling and no renormalization.
            "k3_nolatent": (make_k3(os.path.join(cls.tmp, "k3_nolatent"), layer=1,
                                    latent=False, expert_fmt="bf16", I=64, shards=2, seed=12,
                                    extra_cfg={"num_expert_group": 4, "topk_group": 3,
                                               "moe_renormalize": False,
                                               "routed_scaling_factor": 1.5}), 1),
            # K2 / DeepSeek-V3: FP8 everywhere but the router, partial edge blocks, 4 groups.
            "k2_fp8": (make_k2(os.path.join(cls.tmp, "k2_fp8")), 1),
        }

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_fp32_mode_equals_naive(self):
        for name, (d, layer) in self.ckpts.items():
            for T in (1, 3, 257):
                with self.subTest(ckpt=name, tokens=T):
                    x = make_inputs.make_input((T, 192 if name == "k2_fp8" else 128), seed=T)
                    res = ref.moe_layer_forward(d, layer, x, dtype="fp32")
                    out, ids, w = naive_forward(d, layer, x, "fp32")
                    np.testing.assert_array_equal(res.expert_ids, ids)
                    np.testing.assert_allclose(res.weights, w.astype(np.float32), rtol=1e-6)
                    err = np.abs(res.out - out).max() / np.abs(out).max()
                    # The output file is float32: compare the reference's float64 result too.
                    self.assertLess(err, 1e-6)
                    self.assertGreater(np.abs(out).max(), 0.1)
        # Exactness at float64: the internal float64 result, not the float32 output.
        d, layer = self.ckpts["k3_mxfp4"]
        x = make_inputs.make_input((17, 128), seed=99)
        out, _, _ = naive_forward(d, layer, x, "fp32")
        internal = _forward_float64(d, layer, x)
        self.assertLess(np.abs(internal - out).max() / np.abs(out).max(), 1e-12)

    def test_fp32_mode_float64_internal_all_checkpoints(self):
        for name, (d, layer) in self.ckpts.items():
            with self.subTest(ckpt=name):
                x = make_inputs.make_input((257, 192 if name == "k2_fp8" else 128), seed=5)
                out, _, _ = naive_forward(d, layer, x, "fp32")
                internal = _forward_float64(d, layer, x)
                self.assertLess(np.abs(internal - out).max() / np.abs(out).max(), 1e-12)

    def test_bf16_mode_matches_naive(self):
        # Both round at the same points; only fp64 summation order differs, which can flip a
        # bf16 rounding in rare near-midpoint cases.
        for name, (d, layer) in self.ckpts.items():
            with self.subTest(ckpt=name):
                x = make_inputs.make_input((257, 192 if name == "k2_fp8" else 128), seed=21)
                res = ref.moe_layer_forward(d, layer, x, dtype="bf16")
                out, ids, w = naive_forward(d, layer, x, "bf16")
                np.testing.assert_array_equal(res.expert_ids, ids)
                np.testing.assert_array_equal(res.weights, w.astype(np.float32))
                np.testing.assert_array_equal(ref.round_bf16(res.out), res.out)
                self.assertGreater(np.mean(res.out == out), 0.99)
                self.assertLess(rel_l2(res.out, out), 1e-3)

    def test_bf16_vs_fp32_plausible_difference(self):
        for name, (d, layer) in self.ckpts.items():
            with self.subTest(ckpt=name):
                # A bf16-exact input routes identically in both modes.
                x = ref.round_bf16(make_inputs.make_input(
                    (257, 192 if name == "k2_fp8" else 128), seed=8))
                a = ref.moe_layer_forward(d, layer, x, dtype="bf16")
                b = ref.moe_layer_forward(d, layer, x, dtype="fp32")
                np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
                e = rel_l2(a.out, b.out)
                self.assertGreater(e, 1e-3)
                self.assertLess(e, 3e-2)

    def test_batched_equals_flat(self):
        d, layer = self.ckpts["k3_mxfp4"]
        x = make_inputs.make_input((2, 5, 128), seed=3)
        a = ref.moe_layer_forward(d, layer, x)
        b = ref.moe_layer_forward(d, layer, x.reshape(10, 128))
        self.assertEqual(a.out.shape, (2, 5, 128))
        self.assertEqual(a.expert_ids.shape, (2, 5, 4))
        self.assertEqual(a.near_tie.shape, (2, 5))
        np.testing.assert_array_equal(a.out.reshape(10, 128), b.out)
        np.testing.assert_array_equal(a.expert_ids.reshape(10, 4), b.expert_ids)
        np.testing.assert_array_equal(a.weights.reshape(10, 4), b.weights)

    def test_token_independence(self):
        # A token's result does not depend on the batch around it.
        d, layer = self.ckpts["k2_fp8"]
        x = make_inputs.make_input((257, 192), seed=4)
        full = ref.moe_layer_forward(d, layer, x)
        for t in (0, 100, 256):
            one = ref.moe_layer_forward(d, layer, x[t:t + 1])
            np.testing.assert_array_equal(one.out[0], full.out[t])

    def test_compute_float32_close_to_float64(self):
        for name, (d, layer) in self.ckpts.items():
            with self.subTest(ckpt=name):
                x = make_inputs.make_input((64, 192 if name == "k2_fp8" else 128), seed=9)
                a = ref.moe_layer_forward(d, layer, x, dtype="fp32", compute="float32")
                b = ref.moe_layer_forward(d, layer, x, dtype="fp32", compute="float64")
                same = np.all(a.expert_ids == b.expert_ids, axis=1)
                self.assertGreater(same.mean(), 0.9)
                self.assertLess(rel_l2(a.out[same], b.out[same]), 1e-5)

    def test_cli_and_float16_input(self):
        d, layer = self.ckpts["k3_mxfp4"]
        tmp = tempfile.mkdtemp(prefix="moe_ref_cli_")
        try:
            xin = os.path.join(tmp, "x.npy")
            subprocess.run([PYTHON, os.path.join(HERE, "make_inputs.py"), "--shape", "3,128",
                            "--seed", "5", "--dtype", "float16", "--output", xin], check=True)
            x = np.load(xin)
            self.assertEqual((x.dtype, x.shape), (np.float16, (3, 128)))
            self.assertTrue(np.all(x != 0) or np.count_nonzero(x) > 300)
            paths = {k: os.path.join(tmp, k + ".npy") for k in ("y", "ids", "w", "tie")}
            subprocess.run([PYTHON, os.path.join(HERE, "moe_reference.py"), "--checkpoint", d,
                            "--layer", str(layer), "--input", xin, "--output", paths["y"],
                            "--experts-out", paths["ids"], "--weights-out", paths["w"],
                            "--near-tie-out", paths["tie"], "--near-tie-margin", "1e-3"],
                           check=True)
            y, ids, w, tie = (np.load(paths[k]) for k in ("y", "ids", "w", "tie"))
            self.assertEqual((y.dtype, y.shape), (np.float32, (3, 128)))
            self.assertEqual((ids.dtype, ids.shape), (np.int32, (3, 4)))
            self.assertEqual((w.dtype, w.shape), (np.float32, (3, 4)))
            self.assertEqual((tie.dtype, tie.shape), (np.uint8, (3,)))
            res = ref.moe_layer_forward(d, layer, x, near_tie_margin=1e-3)
            np.testing.assert_array_equal(tie, res.near_tie)
            np.testing.assert_array_equal(y, res.out)
            np.testing.assert_array_equal(ids, res.expert_ids)
            np.testing.assert_array_equal(w, res.weights)
            np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
            bad = subprocess.run([PYTHON, os.path.join(HERE, "moe_reference.py"),
                                  "--checkpoint", d, "--layer", "99", "--input", xin,
                                  "--output", paths["y"]], capture_output=True)
            self.assertNotEqual(bad.returncode, 0)
        finally:
            shutil.rmtree(tmp)

    def test_make_inputs_seeded(self):
        a = make_inputs.make_input((4, 6), seed=1)
        np.testing.assert_array_equal(a, make_inputs.make_input((4, 6), seed=1))
        self.assertFalse(np.array_equal(a, make_inputs.make_input((4, 6), seed=2)))
        self.assertEqual(make_inputs.make_input((2, 3, 4), 0, "float16").dtype, np.float16)
        self.assertTrue(0.5 < a.std() < 1.5)


def _forward_float64(d, layer, x):
    """The reference's fp32-mode result before the final cast to float32."""
    return ref.moe_layer_forward(d, layer, x, dtype="fp32", out_dtype=None).out


@unittest.skipUnless(os.environ.get("MOE_REF_FULL"), "set MOE_REF_FULL=1 (writes ~1 GB)")
class FullWidthTimingTest(unittest.TestCase):

    def test_full_width_k3_257_tokens_float32(self):
        tmp = tempfile.mkdtemp(prefix="moe_ref_full_")
        try:
            H, Lat, I, E, k = 7168, 3584, 3072, 32, 16
            t0 = time.time()
            d = make_k3_fast_full(os.path.join(tmp, "k3"), H, Lat, I, E, k)
            print("\n  wrote full-width checkpoint in %.1f s" % (time.time() - t0))
            xin = os.path.join(tmp, "x.npy")
            np.save(xin, make_inputs.make_input((257, H), seed=1))
            t0 = time.time()
            subprocess.run([PYTHON, os.path.join(HERE, "moe_reference.py"), "--checkpoint", d,
                            "--layer", "1", "--input", xin, "--output",
                            os.path.join(tmp, "y.npy"), "--compute", "float32"], check=True)
            dt = time.time() - t0
            print("  reference, 257 tokens, compute float32: %.1f s" % dt)
            y = np.load(os.path.join(tmp, "y.npy"))
            self.assertTrue(np.all(np.isfinite(y)))
            self.assertLess(dt, 60.0)
        finally:
            shutil.rmtree(tmp)


def make_k3_fast_full(directory, H, Lat, I, E, k):
    """Full-width K3 layer with MXFP4 experts; bf16 bits by truncation (test data only)."""
    rng = np.random.default_rng(0)

    def bf16(shape):
        v = rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))
        return ("BF16", (v.view(np.uint32) >> 16).astype(np.uint16))

    def mx(out, inp):
        c = 127 - round(math.log2(2.93 * math.sqrt(inp)))
        return {"weight_packed": ("U8", rng.integers(0, 256, (out, inp // 2), dtype=np.uint8)),
                "weight_scale": ("U8", np.full((out, inp // 32), c, np.uint8))}

    text = {"model_type": "kimi_linear", "hidden_size": H, "num_experts": E,
            "num_experts_per_token": k, "moe_intermediate_size": I,
            "routed_expert_hidden_size": Lat, "num_shared_experts": 2,
            "latent_moe_use_norm": True, "moe_renormalize": True, "hidden_act": "situ"}
    pre = "language_model.model.layers.1.block_sparse_moe."
    t = {pre + "gate.weight": bf16((E, H)),
         pre + "gate.e_score_correction_bias": ("F32", np.zeros(E, np.float32)),
         pre + "routed_expert_down_proj.weight": bf16((Lat, H)),
         pre + "routed_expert_up_proj.weight": bf16((H, Lat)),
         pre + "routed_expert_norm.weight": ("BF16", np.full(Lat, 0x3F80, np.uint16))}
    for e in range(E):
        add_matrix(t, pre + "experts.%d.w1" % e, mx(I, Lat))
        add_matrix(t, pre + "experts.%d.w3" % e, mx(I, Lat))
        add_matrix(t, pre + "experts.%d.w2" % e, mx(Lat, I))
    S = 2 * I
    t[pre + "shared_experts.gate_proj.weight"] = bf16((S, H))
    t[pre + "shared_experts.up_proj.weight"] = bf16((S, H))
    t[pre + "shared_experts.down_proj.weight"] = bf16((H, S))
    write_checkpoint(directory, {"model_type": "kimi_k3", "text_config": text}, t, shards=4)
    return directory


if __name__ == "__main__":
    unittest.main()
