#!/usr/bin/python3
"""scripts/ab-kernels.py: its sign test, its table for two real moe-bench runs, its errors.

Checks what the script promises, not speed: a row per requested format and M with both sides'
order statistics in order and the paired round count, the exact binomial p-values the verdicts
rest on, and a clear error (not a traceback) for a missing binary or an unknown format.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile

BIN = os.environ["MOE_BIN_DIR"]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "ab-kernels.py")


def load_script():
    spec = importlib.util.spec_from_file_location("ab_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ab = load_script()
    # Exact two-sided binomial tails: 0 of 10 -> 2/1024; 8 of 10 -> 2 (1 + 10 + 45)/1024.
    assert abs(ab.sign_test_p(0, 10) - 2 / 1024) < 1e-12
    assert abs(ab.sign_test_p(10, 10) - 2 / 1024) < 1e-12
    assert abs(ab.sign_test_p(8, 10) - 112 / 1024) < 1e-12
    assert ab.sign_test_p(5, 10) == 1.0 and ab.sign_test_p(0, 0) == 1.0
    assert ab.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0 and ab.quantile([7.0], 0.25) == 7.0

    bench = f"{BIN}/moe-bench"
    run = subprocess.run([sys.executable, SCRIPT, bench, bench, "--rounds", "3", "--rows", "8",
                          "--cols", "320", "--m", "1,3", "--formats", "bf16,mxfp4"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()
            if line.split()[:1] and line.split()[0] in ("bf16", "mxfp4", "fp8")]
    assert [(r[0], int(r[1])) for r in rows] == [("bf16", 1), ("bf16", 3), ("mxfp4", 1),
                                                ("mxfp4", 3)], run.stdout
    for r in rows:
        base_min, base_q1, base_med = map(float, r[3:6])
        new_min, new_q1, new_med = map(float, r[7:10])
        assert 0 < base_min <= base_q1 <= base_med, r
        assert 0 < new_min <= new_q1 <= new_med, r
        assert abs(float(r[11]) - new_med / base_med) < 2e-3 * new_med / base_med + 1e-3, r
        wins, rounds = r[12].split("/")
        assert int(rounds) == 3 and 0 <= int(wins) <= 3, r
        # Three rounds can never reach p < 0.05 (best case 2/8): never a verdict either way.
        assert float(r[13]) >= 0.25 and r[14] == "unclear", r

    # A build 4x slower (moe-bench's times quadrupled on their way out; far beyond this host's
    # run-to-run spread): six rounds, all lost, p = 2/64 -> "slower"; roles swapped, "faster".
    with tempfile.TemporaryDirectory() as tmp:
        slow = os.path.join(tmp, "moe-bench-4x")
        with open(slow, "w") as f:
            f.write("#!/bin/sh\nset -e\n"
                    f"'{bench}' \"$@\" | awk '$1 ~ /^(bf16|mxfp4|fp8)$/ {{ $3 = 4 * $3 }} 1'\n")
        os.chmod(slow, 0o755)
        cases = ((bench, slow, "slower", 4.0), (slow, bench, "faster", 0.25))
        for base, new, verdict, ratio in cases:
            run = subprocess.run([sys.executable, SCRIPT, base, new, "--rounds", "6", "--rows", "64",
                                  "--cols", "1024", "--m", "2", "--formats", "fp8"],
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr
            row = [line.split() for line in run.stdout.splitlines() if line.startswith("   fp8")]
            assert len(row) == 1, run.stdout
            wins = "0/6" if verdict == "slower" else "6/6"
            assert row[0][12] == wins and abs(float(row[0][13]) - 0.031) < 1e-3, row
            assert row[0][14] == verdict and 0.5 * ratio < float(row[0][11]) < 2 * ratio, row

    # --dtype reaches both builds: a wrapper records its arguments and keeps moe-bench's header.
    with tempfile.TemporaryDirectory() as tmp:
        recorder, args_file = os.path.join(tmp, "moe-bench-rec"), os.path.join(tmp, "args")
        with open(recorder, "w") as f:
            f.write(f"#!/bin/sh\nset -e\necho \"$@\" >> '{args_file}'\n'{bench}' \"$@\" | tee -a '{args_file}'\n")
        os.chmod(recorder, 0o755)
        run = subprocess.run([sys.executable, SCRIPT, recorder, recorder, "--rounds", "1", "--rows", "8",
                              "--cols", "256", "--m", "1", "--formats", "bf16", "--dtype", "fp32"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        with open(args_file) as f:
            recorded = f.read()
        assert recorded.count("--dtype fp32") == 2 and recorded.count("fp32 mode") == 2, recorded

    missing = subprocess.run([sys.executable, SCRIPT, "/nonexistent/moe-bench", bench],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "not an executable moe-bench" in missing.stderr, missing
    bad = subprocess.run([sys.executable, SCRIPT, bench, bench, "--formats", "int8"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown format 'int8'" in bad.stderr, bad
    print("ab-kernels: sign test, table and errors as documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
