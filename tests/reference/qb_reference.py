#!/usr/bin/python3
"""Independent torch reference for Quantile Balancing (seed 002, QuantileBalancer.update).

The C++ diagnostics in model/load_balance.cc are tested against this file; it shares no code
with them. The bias update is the seed's snippet transcribed as is:

    top_scores = torch.topk(router_scores + biases, top_k + 1).values
    thresh = top_scores.view(-1, top_k + 1)[:, -1].unsqueeze(-1)
    relative_thresh = thresh - router_scores
    new_biases = torch.quantile(relative_thresh, p, dim=0, interpolation="higher")  # p = k / E
    new_biases = new_biases - new_biases.mean()

Selections are counted with a stable sort on (-biased score, expert index), so ties go to the
lower expert index (torch.topk's tie order is not relied on), with the DeepSeek group limit when
n_group > 1 and topk_group < n_group (group score: sum of the group's two best biased scores;
ties between groups to the lower group index).

Run with Debian's Python (torch 1.13, numpy):

    /usr/bin/python3 tests/reference/qb_reference.py --scores s.npy --bias b.npy --top-k K \
        [--n-group G --topk-group TG] --out-dir DIR

scores: float32 [N, E]; bias: float32 [E]. Writes to DIR:
    quantile.npy            float32 [E]  torch.quantile(..., "higher"), before centering
    bias.npy                float32 [E]  centered as the seed does (fp32 torch mean)
    bias_f64mean.npy        float32 [E]  centered with the fp64 mean rounded once to fp32
                                         (the C++ definition; see model/load_balance.h)
    observed.npy            int64 [E]    selections per expert with the input bias
    predicted.npy           int64 [E]    ... with bias.npy
    predicted_f64mean.npy   int64 [E]    ... with bias_f64mean.npy
"""

import argparse
import os
import sys

import numpy as np
import torch


def quantile_balance(scores, bias, top_k):
    """The seed's update. scores: float32 [N, E] tensor, bias: float32 [E].

    Returns (quantile, bias_seed, bias_f64mean), each float32 [E].
    """
    n, num_experts = scores.shape
    if n < 1:
        raise ValueError("no tokens")
    if not 1 <= top_k <= num_experts - 1:
        raise ValueError("top_k %d outside [1, %d]" % (top_k, num_experts - 1))
    router_scores = scores
    biases = bias
    top_scores = torch.topk(router_scores + biases, top_k + 1, dim=-1).values
    thresh = top_scores.view(-1, top_k + 1)[:, -1].unsqueeze(-1)
    relative_thresh = thresh - router_scores
    p = top_k / num_experts
    new_biases = torch.quantile(relative_thresh, p, dim=0, interpolation="higher")
    quantile = new_biases.clone()
    seed = new_biases - new_biases.mean()
    f64mean = new_biases - new_biases.double().mean().float()
    return quantile, seed, f64mean


def select_experts(scores, bias, top_k, n_group=1, topk_group=1):
    """Expert ids [N, top_k] of the top-k biased scores, ties to the lower index."""
    n, num_experts = scores.shape
    biased = scores + bias
    if n_group > 1 and topk_group < n_group:
        per = num_experts // n_group
        grouped = biased.view(n, n_group, per)
        best = torch.sort(grouped, dim=-1, descending=True).values
        group_score = best[..., 0] + best[..., 1] if per >= 2 else best[..., 0]
        keep_groups = torch.sort(-group_score, dim=-1, stable=True).indices[:, :topk_group]
        keep = torch.zeros(n, n_group, dtype=torch.bool)
        keep.scatter_(1, keep_groups, True)
        keep = keep.repeat_interleave(per, dim=1)
        biased = biased.masked_fill(~keep, float("-inf"))
    # Stable ascending sort of the negated scores: equal scores keep ascending expert order.
    return torch.sort(-biased, dim=-1, stable=True).indices[:, :top_k]


def count_selections(scores, bias, top_k, n_group=1, topk_group=1):
    ids = select_experts(scores, bias, top_k, n_group, topk_group)
    return torch.bincount(ids.reshape(-1), minlength=scores.shape[1]).to(torch.int64)


def balancedness(counts):
    counts = np.asarray(counts, dtype=np.float64)
    top = counts.max() if counts.size else 0.0
    return 1.0 if top == 0 else float(counts.mean() / top)


def run(scores, bias, top_k, n_group=1, topk_group=1):
    """All outputs of the CLI as a dict of numpy arrays."""
    quantile, seed, f64mean = quantile_balance(scores, bias, top_k)

    def count(b):
        return count_selections(scores, b, top_k, n_group, topk_group).numpy()

    return {
        "quantile": quantile.numpy(),
        "bias": seed.numpy(),
        "bias_f64mean": f64mean.numpy(),
        "observed": count(bias),
        "predicted": count(seed),
        "predicted_f64mean": count(f64mean),
    }


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scores", required=True, help="float32 [N, E] raw router scores")
    ap.add_argument("--bias", required=True, help="float32 [E] current selection bias")
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--n-group", type=int, default=1)
    ap.add_argument("--topk-group", type=int, default=1)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    scores = np.load(args.scores)
    bias = np.load(args.bias)
    if scores.dtype != np.float32 or bias.dtype != np.float32:
        raise SystemExit("scores and bias must be float32")
    if scores.ndim != 2 or bias.shape != (scores.shape[1],):
        raise SystemExit("need scores [N, E] and bias [E]; got %s and %s"
                         % (scores.shape, bias.shape))
    outputs = run(torch.from_numpy(scores), torch.from_numpy(bias), args.top_k, args.n_group,
                  args.topk_group)
    os.makedirs(args.out_dir, exist_ok=True)
    for name, value in outputs.items():
        np.save(os.path.join(args.out_dir, name + ".npy"), value)
    print("qb_reference: N=%d E=%d k=%d balancedness observed %.4f predicted %.4f"
          % (scores.shape[0], scores.shape[1], args.top_k, balancedness(outputs["observed"]),
             balancedness(outputs["predicted"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
