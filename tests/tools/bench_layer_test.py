#!/usr/bin/python3
"""moe-bench layer end to end on a small generated checkpoint (k3-mini, one layer).

Checks what the benchmark promises, not speed: every requested token count has a row naming the
kernel tier, the roofline is max(bytes / read bandwidth, FLOPs / compute peak) with the row's own
bandwidth and peak of the tier's own multiply-add (each the best probe around the row's runs),
the weights read grow with the experts touched, and the JSON agrees with the table. Speed targets
live in the committed runs (docs/bench), never in a test.
"""
import json
import os
import subprocess
import sys
import tempfile

BIN = os.environ["MOE_BIN_DIR"]


LABEL = 'k3-mini\'s "layer"'


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        subprocess.run([f"{BIN}/moe-ckpt", "--preset", "k3-mini", "--layers", "1", "--out", ckpt],
                       check=True, capture_output=True)
        out_json = os.path.join(tmp, "bench.json")
        # The chart too (gnuplot-nox is a declared dependency), with a quote in the label and in
        # the path, which gnuplot's quoted strings must escape; the JSON string escapes the label's
        # double quotes.
        plot_dir = os.path.join(tmp, "it's here")
        os.mkdir(plot_dir)
        out_png = os.path.join(plot_dir, "bench.png")
        run = subprocess.run(
            [f"{BIN}/moe-bench", "layer", "--checkpoint", ckpt, "--tokens", "1,3,257",
             "--repeat", "3", "--threads", "2", "--buffer-gb", "0.25", "--json", out_json,
             "--plot", out_png, "--label", LABEL],
            check=True, capture_output=True, text=True, timeout=600)
        table = run.stdout
        with open(out_json) as f:
            res = json.load(f)
        # The charts of scripts/plot-bench.py, the per-stage bandwidth bars among them.
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        subprocess.run(["/usr/bin/python3", os.path.join(source, "scripts", "plot-bench.py"), out_json],
                       check=True, capture_output=True, timeout=300)
        for chart in ("xroofline", "stages", "bandwidth"):
            with open(os.path.join(tmp, f"bench-{chart}.png"), "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", chart
        assert "gnuplot failed" not in run.stderr, run.stderr
        with open(out_png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", out_png
        with open(out_png + ".gp") as f:
            assert "k3-mini''s \"layer\"" in f.read()
    rows = res["rows"]
    assert [r["tokens"] for r in rows] == [1, 3, 257], rows
    assert res["read_gbps"] > 0 and res["peak_gflops"] > 0 and res["peak_source"], res
    assert res["tier"] in res["backend"], res
    # The host as /proc/cpuinfo names it, so that committed results say where they ran.
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    model = next(l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith("model name"))
    assert res["host"]["cpu"] == model, res["host"]
    assert res["model"] == LABEL, res["model"]
    field = lambda k: next(l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.split(":")[0].strip() == k)
    assert res["host"]["vendor"] == f'{field("vendor_id")} family {field("cpu family")} model {field("model")}', res["host"]
    host_flags = next(l.split(":", 1)[1].split() for l in cpuinfo.splitlines() if l.startswith("flags"))
    want = sorted(f for f in host_flags if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "amx")))
    assert res["host"]["flags"].split() == want, (res["host"], want)
    prev = None
    for r in rows:
        assert r["runs"] >= 3 and 0 < r["min_ms"] <= r["median_ms"], r
        assert r["read_gbps"] > 0 and r["peak_gflops"] > 0, r
        assert 1 <= r["experts_touched"] <= res["experts"], r
        # The JSON rounds times to 1e-4 ms: compare within that (relative 2e-3 at the smallest).
        bw_ms = 1e3 * r["weight_bytes"] / (r["read_gbps"] * 1e9)
        assert abs(bw_ms - r["bw_ms"]) <= 2e-3 * bw_ms + 1e-4, (bw_ms, r)
        flop_ms = 1e3 * r["flops"] / (r["peak_gflops"] * 1e9)
        assert abs(flop_ms - r["flop_ms"]) <= 2e-3 * flop_ms + 1e-4, (flop_ms, r)
        assert abs(r["roofline_ms"] - max(r["bw_ms"], r["flop_ms"])) <= 1e-4, r
        assert r["tier"] == res["tier"], r
        x = r["median_ms"] / r["roofline_ms"]
        assert abs(r["x_roofline"] - x) <= 5e-3 * x, r
        if prev is not None:  # more tokens touch at least as many experts and FLOPs
            assert r["experts_touched"] >= prev["experts_touched"], (prev, r)
            assert r["weight_bytes"] >= prev["weight_bytes"] and r["flops"] > prev["flops"]
        # The stages: route, experts, shared, finish; their bytes and FLOPs are the row's, each
        # rate is its bytes (FLOPs) over its time, each share over the row's probe (peak).
        stages = r["stages"]
        assert [st["stage"] for st in stages] == ["route", "experts", "shared", "finish"], stages
        assert abs(sum(st["weight_bytes"] for st in stages) - r["weight_bytes"]) <= 4, (stages, r)
        assert abs(sum(st["flops"] for st in stages) - r["flops"]) <= 4, (stages, r)
        assert all(st["weight_bytes"] > 0 and st["flops"] > 0 for st in stages), stages
        assert sum(st["ms"] for st in stages) <= r["median_ms"] * 1.05 + 0.05, (stages, r)
        for st in stages:
            # The JSON rounds ms to 1e-6 and rates to 1e-3: compare within that.
            ms = max(st["ms"], 1e-6)
            rel = 1e-3 + 1e-6 / ms
            assert abs(st["gbps"] - st["weight_bytes"] / (ms * 1e6)) <= rel * st["gbps"] + 2e-3, st
            assert abs(st["read_share"] - st["gbps"] / r["read_gbps"]) <= 1e-3 * st["read_share"] + 1e-4, st
            assert abs(st["gflops"] - st["flops"] / (ms * 1e6)) <= rel * st["gflops"] + 2e-3, st
            assert abs(st["peak_share"] - st["gflops"] / r["peak_gflops"]) <= 1e-3 * st["peak_share"] + 1e-4, st
        prev = r
        # The printed table has the same row.
        line = next(l for l in table.splitlines() if l.split() and l.split()[0] == str(r["tokens"]))
        assert line.split()[1] == r["tier"], (line, r)
        assert abs(float(line.split()[2]) - r["median_ms"]) < 0.01, (line, r)
        assert abs(float(line.split()[8]) - r["peak_gflops"]) <= 0.5, (line, r)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
