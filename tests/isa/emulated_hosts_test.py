#!/usr/bin/python3
"""The binaries on x86-64 hosts without AVX-512, emulated by qemu-user.

QEMU's TCG implements no AVX-512 instruction, so any AVX-512 code reached on these emulated CPUs
dies with SIGILL, exactly as on a real Zen 1-3 or Haswell host. For each CPU model:
  - the kernel tests of every tier run, and those of the tiers the CPU lacks skip, naming it;
  - moe-bench roofline and layer run (read probe, compute probes, the layer);
  - moe-forward on k3-mini picks the best tier the CPU has and gives the bytes the portable
    kernels give natively;
  - forcing a tier the CPU lacks is refused with a clear error, not a crash.
"""
import os
import subprocess
import sys
import tempfile

BIN = os.environ["MOE_BIN_DIR"]
QEMU = os.environ.get("MOE_QEMU", "qemu-x86_64")

# QEMU model -> the tier that CPU runs best.
HOSTS = [("EPYC", "avx2"), ("Nehalem", "portable")]


def emulated(cpu, args, env=None, check=True, timeout=900):
    full_env = dict(os.environ)
    full_env.pop("MOE_CPU_KERNELS", None)
    full_env.update(env or {})
    run = subprocess.run([QEMU, "-cpu", cpu] + args, env=full_env, capture_output=True, text=True,
                         timeout=timeout)
    # TCG warns about each host feature of the model it does not implement; not ours.
    stderr = "\n".join(l for l in run.stderr.splitlines()
                       if not l.startswith("qemu-x86_64: warning: TCG doesn't support"))
    if check and run.returncode != 0:
        raise AssertionError(f"{cpu}: {' '.join(args)} exited {run.returncode}\n"
                             f"{run.stdout[-3000:]}\n{stderr[-3000:]}")
    return run.returncode, run.stdout, stderr


def check_kernel_tests(cpu, tier):
    # The tier choice and a sample of every tier's bit-for-bit checks (every FP8 and MXFP4 code
    # through every kernel path, row lists, GLU, packing; the wide shape sweep of TierDotTest
    # runs natively, where it is 50x faster than under TCG).
    _, out, _ = emulated(cpu, [f"{BIN}/kernels_test",
                               "--gtest_filter=AllTiers/TierCodeTest.*:AllTiers/TierActivationTest.*:"
                               "Tiers*:TierCheck*", "--gtest_brief=0"])
    assert "FAILED" not in out, out[-3000:]
    for name in ["avx512_bf16", "avx512"]:
        assert f"AllTiers/TierCodeTest.RowListEqualsGatheredRows/{name}" in out, out[-2000:]
    skipped = [l for l in out.splitlines() if "[  SKIPPED ]" in l and "/avx2" in l]
    ran_avx2 = [l for l in out.splitlines() if "[       OK ]" in l and "/avx2" in l]
    if tier == "avx2":
        assert ran_avx2 and not skipped, out[-3000:]
    else:
        assert not ran_avx2, out[-3000:]
    assert "needs AVX-512" in out, "a skipped tier names what it lacks"
    print(f"  {cpu}: kernel tests pass; {len(ran_avx2)} avx2 tests ran")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "k3-mini")
        subprocess.run([f"{BIN}/moe-ckpt", "--preset", "k3-mini", "--layers", "1", "--out", ckpt,
                        "--quiet"], check=True)
        x = os.path.join(tmp, "x.npy")
        import numpy as np
        rng = np.random.default_rng(3)
        np.save(x, rng.standard_normal((37, 640)).astype(np.float32))
        native = os.path.join(tmp, "y_portable.npy")
        subprocess.run([f"{BIN}/moe-forward", "--checkpoint", ckpt, "--input", x, "--output",
                        native, "--kernels", "portable", "--threads", "2"], check=True,
                       capture_output=True)
        with open(native, "rb") as f:
            want = f.read()
        for cpu, tier in HOSTS:
            print(f"{cpu} (best tier {tier}):")
            for binary in ["moe-gateway", "moe-rank", "moe-cluster", "moe-client", "moe-ckpt",
                           "moe-forward", "moe-bench"]:
                code, out, err = emulated(cpu, [f"{BIN}/{binary}", "--help"], check=False)
                assert code in (0, 2) and binary in out + err, (binary, code, err)
            check_kernel_tests(cpu, tier)
            # The GEMM library's reference timing is skipped: seconds of GEMM are hours under TCG.
            _, out, err = emulated(cpu, [f"{BIN}/moe-bench", "roofline", "--buffer-gb", "0.03",
                                         "--gemm=false"])
            assert "tier avx512-bf16  not on this host" in out, out
            assert f"tier {tier:<12} bf16 mode:" in out and "GFLOP/s" in out, out
            if tier != "avx2":
                assert "tier avx2         not on this host" in out, out
            _, out, err = emulated(cpu, [f"{BIN}/moe-bench", "layer", "--checkpoint", ckpt,
                                         "--tokens", "1,3", "--repeat", "3", "--buffer-gb", "0.03",
                                         "--gemm=false"])
            assert f"cpu({tier}, " in out, out
            y = os.path.join(tmp, f"y_{cpu}.npy")
            _, _, err = emulated(cpu, [f"{BIN}/moe-forward", "--checkpoint", ckpt, "--input", x,
                                       "--output", y, "--threads", "2"])
            assert f"cpu({tier}, 2 threads)" in err, err
            if tier == "portable":
                assert "using the portable kernels" in err, "a fallback to portable warns: " + err
            with open(y, "rb") as f:
                assert f.read() == want, f"{cpu}: the layer differs from the portable kernels'"
            print(f"  {cpu}: moe-bench ran; moe-forward bit-identical to the portable kernels")
            code, _, err = emulated(cpu, [f"{BIN}/moe-forward", "--checkpoint", ckpt, "--input", x,
                                          "--output", y], env={"MOE_CPU_KERNELS": "avx512-bf16"},
                                    check=False)
            assert code == 1 and "needs AVX-512" in err and "lacks" in err, (code, err)
            print(f"  {cpu}: MOE_CPU_KERNELS=avx512-bf16 refused: {err.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
