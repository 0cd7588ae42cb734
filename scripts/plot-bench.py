#!/usr/bin/python3
"""Charts of `moe-bench layer --json` results (Debian's python3-matplotlib):

    scripts/plot-bench.py docs/bench/k3-full-cpu.json [more.json ...]

For each FILE.json writes FILE-xroofline.png (measured time over the roofline of the same run,
per token count: 1.0 is the machine's limit), FILE-stages.png (the layer's time split into its
stages, stacked: route, routed experts, shared experts, finish) and, for runs that carry per-stage
figures, FILE-bandwidth.png (each stage's weight bytes per second as a share of the read probe of
its row: 100% is the memory's limit). Titles are plain text.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=wrong-import-position

STAGES = [("route_ms", "route (router, latent down-projection)"), ("experts_ms", "routed experts"),
          ("shared_ms", "shared experts"), ("finish_ms", "finish (combine, up-projection, norm)")]


def title(run):
    return f"{run['model']} ({run['experts']} experts, top-{run['top_k']}, {run['expert_format']}), {run['backend']}"


def plot_x_roofline(run, out):
    tokens = [r["tokens"] for r in run["rows"]]
    ratio = [r["median_ms"] / r["roofline_ms"] for r in run["rows"]]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(tokens, ratio, "o-", lw=2, label="measured / roofline (median)")
    ax.axhline(1.0, color="gray", ls="--", lw=1, label="roofline: max(bytes / read BW, FLOPs / peak)")
    for t, r in zip(tokens, ratio):
        ax.annotate(f"{r:.2f}x", (t, r), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens)
    ax.set_xticklabels([str(t) for t in tokens])
    ax.set_ylim(0, max(ratio) * 1.2)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("x roofline (lower is better)")
    ax.set_title(title(run), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_stages(run, out):
    rows = run["rows"]
    labels = [str(r["tokens"]) for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    bottom = [0.0] * len(rows)
    for key, name in STAGES:
        share = [100.0 * r[key] / r["median_ms"] for r in rows]
        ax.bar(labels, share, bottom=bottom, label=name)
        bottom = [b + s for b, s in zip(bottom, share)]
    for i, r in enumerate(rows):
        ax.annotate(f"{r['median_ms']:.1f} ms", (i, min(bottom[i], 100)), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=8)
    ax.set_ylim(0, 115)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("% of the layer's median time")
    ax.set_title("stage split: " + title(run), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_bandwidth(run, out):
    rows = run["rows"]
    labels = [str(r["tokens"]) for r in rows]
    names = [st["stage"] for st in rows[0]["stages"]]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    for k, name in enumerate(names):
        share = [100.0 * r["stages"][k]["read_share"] for r in rows]
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(rows))]
        bars = ax.bar(xs, share, width, label=name)
        for bar, v in zip(bars, share):
            ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), textcoords="offset points",
                        xytext=(0, 2), ha="center", fontsize=7)
    ax.axhline(100, color="gray", ls="--", lw=1, label="read probe of the row")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("weight GB/s, % of the read probe")
    ax.set_title("stage bandwidth: " + title(run), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(paths):
    if not paths:
        sys.exit(__doc__)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        stem = os.path.splitext(path)[0]
        plot_x_roofline(run, stem + "-xroofline.png")
        plot_stages(run, stem + "-stages.png")
        written = [f"{stem}-xroofline.png", f"{stem}-stages.png"]
        if all("stages" in r for r in run["rows"]):
            plot_bandwidth(run, stem + "-bandwidth.png")
            written.append(f"{stem}-bandwidth.png")
        print("plot-bench: " + ", ".join(written))


if __name__ == "__main__":
    main(sys.argv[1:])
