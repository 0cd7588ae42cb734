#!/usr/bin/python3
"""Self-checks of the Quantile Balancing reference (qb_reference.py).

  /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_qb*.py'

Expected values come from plain loops over numpy float32 scalars (each + and - is one fp32
operation, as in torch) and from torch.quantile's documented "higher" rule, not from the
reference's own code paths.
"""

import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qb_reference as qb  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3"
f32 = np.float32


def higher_index(n, p):
    """torch.quantile's "higher" sample index: ceil of the rank q * (n - 1) taken in fp32."""
    return min(n - 1, int(math.ceil(float(f32(f32(p) * f32(n - 1))))))


def loop_quantile_balance(s, b, k):
    """Quantiles and seed-centered bias from loops over float32 scalars."""
    n, e_count = s.shape
    cutoff = []
    for t in range(n):
        row = sorted((f32(s[t, e]) + f32(b[e]) for e in range(e_count)), reverse=True)
        cutoff.append(row[k])  # the (k+1)-th largest, ties counted with multiplicity
    index = higher_index(n, k / e_count)
    quantile = np.empty(e_count, dtype=np.float32)
    for e in range(e_count):
        column = sorted(f32(cutoff[t] - f32(s[t, e])) for t in range(n))
        quantile[e] = column[index]
    return quantile


def loop_counts(s, b, k):
    n, e_count = s.shape
    counts = np.zeros(e_count, dtype=np.int64)
    for t in range(n):
        biased = [f32(s[t, e]) + f32(b[e]) for e in range(e_count)]
        order = sorted(range(e_count), key=lambda e: (-biased[e], e))
        for e in order[:k]:
            counts[e] += 1
    return counts


def sigmoid_scores(rng, n, e_count, scale=1.0):
    z = rng.standard_normal((n, e_count)).astype(np.float32) * f32(scale)
    return torch.sigmoid(torch.from_numpy(z)).numpy()


class HigherIndexTest(unittest.TestCase):
    def test_torch_quantile_higher_is_the_fp32_rank_ceiling(self):
        # Over many (n, p): torch picks sorted[ceil(fp32(fp32(p) * (n - 1)))]. The samples are
        # 0..n-1, so the value is the index.
        cases = [(n, k / e) for e in (3, 10, 20, 48, 64, 384, 896) for k in (1, 2, 3, 6, 8, 13,
                                                                               16, e - 1)
                 if k < e for n in (1, 2, 3, 25, 50, 51, 100, 216, 257, 1000)]
        for n, p in cases:
            x = torch.arange(n, dtype=torch.float32)
            got = int(torch.quantile(x, p, interpolation="higher").item())
            self.assertEqual(got, higher_index(n, p), (n, p))

    def test_fp32_rank_can_exceed_the_exact_ceiling(self):
        # 0.3 * 50 = 15 exactly, but fp32(0.3) * 50 rounds to 15.000001: torch picks index 16.
        x = torch.arange(51, dtype=torch.float32)
        self.assertEqual(torch.quantile(x, 3 / 10, interpolation="higher").item(), 16.0)
        self.assertEqual(math.ceil(3 * 50 / 10), 15)
        self.assertEqual(higher_index(51, 3 / 10), 16)

    def test_torch_limit_is_2_pow_24_samples(self):
        with self.assertRaises(RuntimeError):
            torch.quantile(torch.zeros((1 << 24) + 1), 0.5, interpolation="higher")


class QuantileBalanceTest(unittest.TestCase):
    def test_matches_loops_on_random_windows(self):
        rng = np.random.default_rng(1)
        for n, e_count, k in [(1, 4, 1), (7, 4, 3), (51, 10, 3), (64, 16, 2), (200, 12, 11)]:
            s = sigmoid_scores(rng, n, e_count)
            b = (rng.standard_normal(e_count) * 0.1).astype(np.float32)
            quantile, seed, f64mean = qb.quantile_balance(torch.from_numpy(s),
                                                          torch.from_numpy(b), k)
            expected = loop_quantile_balance(s, b, k)
            np.testing.assert_array_equal(quantile.numpy(), expected)
            # Centering: both variants are quantile - (a mean within an ulp or two).
            np.testing.assert_allclose(seed.numpy(), f64mean.numpy(), rtol=0, atol=1e-6)
            mean64 = np.float32(np.mean(expected.astype(np.float64)))
            np.testing.assert_array_equal(f64mean.numpy(), expected - mean64)
            self.assertLess(abs(float(seed.double().mean())), 1e-6)

    def test_ties_in_scores(self):
        # Scores on a grid of eighths: many exact ties, both in the cutoff and in the columns.
        rng = np.random.default_rng(2)
        s = (rng.integers(0, 9, size=(100, 8)) / 8).astype(np.float32)
        b = np.array([0, 0, 0.125, 0.125, 0, 0, -0.125, 0], dtype=np.float32)
        for k in (1, 2, 4, 7):
            quantile, _, _ = qb.quantile_balance(torch.from_numpy(s), torch.from_numpy(b), k)
            np.testing.assert_array_equal(quantile.numpy(), loop_quantile_balance(s, b, k))
            np.testing.assert_array_equal(
                qb.count_selections(torch.from_numpy(s), torch.from_numpy(b), k).numpy(),
                loop_counts(s, b, k))

    def test_hand_example(self):
        # Same window as the C++ unit test: E = 4, k = 1, p = 1/4, N = 4 -> index 1.
        s = np.array([[0.9, 0.5, 0.5, 0.1], [0.8, 0.7, 0.2, 0.1], [0.6, 0.1, 0.3, 0.4],
                      [0.5, 0.5, 0.5, 0.5]], dtype=np.float32)
        b = np.zeros(4, dtype=np.float32)
        quantile, _, _ = qb.quantile_balance(torch.from_numpy(s), torch.from_numpy(b), 1)
        cut = [f32(0.5), f32(0.7), f32(0.4), f32(0.5)]
        expected = [sorted(cut[t] - s[t, e] for t in range(4))[1] for e in range(4)]
        np.testing.assert_array_equal(quantile.numpy(), np.array(expected, dtype=np.float32))
        counts = qb.count_selections(torch.from_numpy(s), torch.from_numpy(b), 1).numpy()
        np.testing.assert_array_equal(counts, [4, 0, 0, 0])  # argmax, ties to expert 0

    def test_k_equals_e_minus_one_uses_the_row_minimum(self):
        rng = np.random.default_rng(3)
        s = sigmoid_scores(rng, 30, 5)
        b = np.zeros(5, dtype=np.float32)
        quantile, _, _ = qb.quantile_balance(torch.from_numpy(s), torch.from_numpy(b), 4)
        relative = s.min(axis=1, keepdims=True) - s
        expected = np.sort(relative, axis=0)[higher_index(30, 4 / 5)]
        np.testing.assert_array_equal(quantile.numpy(), expected)

    def test_rejects_bad_top_k_and_empty_window(self):
        s = torch.full((3, 4), 0.5)
        b = torch.zeros(4)
        for k in (0, 4):
            with self.assertRaises(ValueError):
                qb.quantile_balance(s, b, k)
        with self.assertRaises(ValueError):
            qb.quantile_balance(torch.zeros(0, 4), b, 1)

    def test_skewed_router_is_rebalanced(self):
        rng = np.random.default_rng(4)
        s = sigmoid_scores(rng, 4096, 64)
        b = np.zeros(64, dtype=np.float32)
        b[:6] = 0.3
        out = qb.run(torch.from_numpy(s), torch.from_numpy(b), 2)
        observed, predicted = qb.balancedness(out["observed"]), qb.balancedness(out["predicted"])
        self.assertLess(observed, 0.2)
        self.assertGreater(predicted, observed + 0.3)


class CountSelectionsTest(unittest.TestCase):
    def test_ties_go_to_the_lower_index(self):
        s = torch.full((1, 6), 0.5)
        b = torch.zeros(6)
        np.testing.assert_array_equal(qb.count_selections(s, b, 3).numpy(), [1, 1, 1, 0, 0, 0])

    def test_matches_loops(self):
        rng = np.random.default_rng(5)
        s = (rng.integers(0, 5, size=(300, 16)) / 4).astype(np.float32)
        b = (rng.integers(-1, 2, size=16) / 4).astype(np.float32)
        for k in (1, 3, 15):
            np.testing.assert_array_equal(
                qb.count_selections(torch.from_numpy(s), torch.from_numpy(b), k).numpy(),
                loop_counts(s, b, k))

    def test_group_limit(self):
        # 3 groups of 2: group scores 1.0, 1.2, 0.9 (same case as the C++ unit test).
        s = torch.tensor([[0.9, 0.1, 0.6, 0.6, 0.7, 0.2]])
        b = torch.zeros(6)
        self.assertEqual(qb.count_selections(s, b, 2, 3, 1).tolist(), [0, 0, 1, 1, 0, 0])
        self.assertEqual(qb.count_selections(s, b, 2, 3, 2).tolist(), [1, 0, 1, 0, 0, 0])
        self.assertEqual(qb.count_selections(s, b, 2, 3, 3).tolist(), [1, 0, 0, 0, 1, 0])


class CliTest(unittest.TestCase):
    def test_writes_all_outputs(self):
        rng = np.random.default_rng(6)
        s = sigmoid_scores(rng, 100, 8)
        b = (rng.standard_normal(8) * 0.05).astype(np.float32)
        with tempfile.TemporaryDirectory() as tmp:
            np.save(os.path.join(tmp, "s.npy"), s)
            np.save(os.path.join(tmp, "b.npy"), b)
            out = os.path.join(tmp, "out")
            subprocess.run([PYTHON, os.path.join(HERE, "qb_reference.py"), "--scores",
                            os.path.join(tmp, "s.npy"), "--bias", os.path.join(tmp, "b.npy"),
                            "--top-k", "2", "--out-dir", out], check=True,
                           stdout=subprocess.DEVNULL)
            q = np.load(os.path.join(out, "quantile.npy"))
            self.assertEqual(q.dtype, np.float32)
            np.testing.assert_array_equal(q, loop_quantile_balance(s, b, 2))
            observed = np.load(os.path.join(out, "observed.npy"))
            self.assertEqual(observed.dtype, np.int64)
            np.testing.assert_array_equal(observed, loop_counts(s, b, 2))
            for name in ("bias", "bias_f64mean", "predicted", "predicted_f64mean"):
                self.assertEqual(np.load(os.path.join(out, name + ".npy")).shape, (8,))
            np.testing.assert_array_equal(np.load(os.path.join(out, "predicted.npy")),
                                          loop_counts(s, np.load(os.path.join(out, "bias.npy")),
                                                      2))


if __name__ == "__main__":
    unittest.main()
