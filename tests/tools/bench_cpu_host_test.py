#!/usr/bin/python3
"""scripts/bench-cpu-host.sh end to end on small checkpoints (what it writes and prints, not
speed): the host label and tier in the file names, a forced lower tier marked as a proxy run,
the JSON and charts of each model, and a target table whose ratios and verdicts follow from
the JSON (K3 within 2x, K2 within 2.5x, at their token counts).

The script generates full-size checkpoints only where none exist; the test puts small ones
(k3-mini's shapes, a K2 with 16 experts) where it looks.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

BIN = os.environ["MOE_BIN_DIR"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best_tier():
    out = subprocess.run([f"{BIN}/moe-bench", "kernels", "--rows", "16", "--cols", "128", "--m",
                          "1"], check=True, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "MOE_CPU_KERNELS"})
    return re.search(r"cpu\(([a-z0-9-]+),", out.stdout).group(1)


def main() -> int:
    best = best_tier()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "bench")
        subprocess.run([f"{BIN}/moe-ckpt", "--preset", "k3-mini", "--layers", "1", "--out",
                        os.path.join(ckpt, "k3")], check=True, capture_output=True)
        subprocess.run([f"{BIN}/moe-ckpt", "--preset", "kimi-k2", "--layers", "1", "--hidden",
                        "256", "--expert-hidden", "128", "--experts", "16", "--top-k", "4",
                        "--out", os.path.join(ckpt, "k2")], check=True, capture_output=True)
        run = subprocess.run(
            ["bash", os.path.join(ROOT, "scripts", "bench-cpu-host.sh"), "--kernels", "portable",
             "--tokens", "1,16", "--repeat", "3", "--ckpt-dir", ckpt, "--out", out,
             "--host-label", "testhost"],
            capture_output=True, text=True, timeout=900)  # MOE_BIN_DIR: the binaries under test
        assert run.returncode == 0, run.stdout + run.stderr
        text = run.stdout
        proxy = best != "portable"
        suffix = "portable-on-testhost" if proxy else "portable-testhost"
        assert ("a proxy run" in text) == proxy, (best, text)
        table = [l.split() for l in text.splitlines() if l.split()[:1] in (["k3"], ["k2"])]
        assert [(r[0], r[1]) for r in table] == [("k3", "1"), ("k3", "16"), ("k2", "1"),
                                                 ("k2", "16")], text
        for model, limit in (("k3", 2.0), ("k2", 2.5)):
            base = os.path.join(out, f"{model}-full-cpu-{suffix}")
            for ext in (".png", "-stages.png", "-xroofline.png"):
                with open(base + ext, "rb") as f:
                    assert f.read(8) == b"\x89PNG\r\n\x1a\n", base + ext
            with open(base + ".json") as f:
                res = json.load(f)
            assert res["tier"] == "portable", res
            assert ("a proxy run" in res["model"]) == proxy and "testhost host" in res["model"]
            for r, line in zip(res["rows"], [t for t in table if t[0] == model]):
                x = r["median_ms"] / r["roofline_ms"]
                assert abs(float(line[4]) - x) <= 0.006, (line, r)
                verdict = "meets" if x <= limit else "misses"  # 1 and 16: targets of both
                assert line[5:7] == [f"{limit}x", verdict], (line, r)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
