#!/usr/bin/python3
"""moe-bench's compute-peak probes run from registers (tools/bench/probes.cc).

A roofline is only as good as its peak: left to GCC, the 24-chain zmm probe loops kept their
accumulators on the stack (a load, a multiply-add from memory and a store per step), and on a
Zen 5 host the fp32 FMA zmm "peak" read 188 instead of 475 GFLOP/s. A timing cannot tell that
reliably on a shared host, the code can: each probe's loop must hold at least one multiply-add
per chain with register operands only, and none that reads memory.
"""
import os
import re
import shutil
import subprocess
import sys

BIN = os.environ["MOE_BIN_DIR"]
# Probe function -> (its multiply-add mnemonic, independent chains in the source).
PROBES = {
    "FmaLoopYmm": (r"vfmadd\d+ps", 12),
    "FmaLoopZmm": (r"vfmadd\d+ps", 24),
    "Bf16DotLoopZmm": (r"vdpbf16ps", 24),
}


def disassembly(binary: str) -> dict:
    """Instruction lines of each probe function, by name."""
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils) is needed to read the probes' code"
    out = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", binary], capture_output=True,
                         text=True, check=True).stdout
    functions, current = {}, None
    for line in out.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            current = next((p for p in PROBES if f"::{p}(" in header.group(1)), None)
            if current:
                functions[current] = []
        elif not line.strip():
            current = None
        elif current:
            functions[current].append(line)
    return functions


def main() -> int:
    functions = disassembly(f"{BIN}/moe-bench")
    failures = []
    for name, (mnemonic, chains) in PROBES.items():
        code = functions.get(name)
        if code is None:
            failures.append(f"{name}: not found in moe-bench")
            continue
        ops = [line for line in code if re.search(rf"\s{mnemonic}\s", line)]
        from_memory = [line.strip() for line in ops if "(" in line]
        in_registers = len(ops) - len(from_memory)
        if from_memory:
            failures.append(f"{name}: {len(from_memory)} multiply-adds read memory, e.g. "
                            f"'{from_memory[0]}' (accumulators spilled?)")
        if in_registers < chains:
            failures.append(f"{name}: {in_registers} register multiply-adds, fewer than its "
                            f"{chains} chains (loop not unrolled)")
        print(f"{name}: {in_registers} register multiply-adds, {len(from_memory)} from memory")
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
