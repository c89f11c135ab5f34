#!/usr/bin/env python3
"""Instruction mix of a kernel's loops from its SASS (machine code), to set against timings.

Usage:
  python ffi/tools/sass_mix.py OBJ --list                       # the kernels, numbered
  python ffi/tools/sass_mix.py OBJ --kernel N                   # its loops (backward branches)
  python ffi/tools/sass_mix.py OBJ --kernel N --blocks LO-HI    # the basic blocks of a range
  python ffi/tools/sass_mix.py OBJ --kernel N --sum A-B,C-D --values V
                                                                # a chosen path, per value

OBJ is an object file or shared module with sm_XX code (e.g. the build's
CMakeFiles/echo_cuda_kernels.dir/ffi/p2p_fast_f32.cu.o, the fast stages for fp32) or a text file of `cuobjdump -sass`
output; cuobjdump must be on PATH for the former. Addresses are hex, as cuobjdump prints them.

--sum adds the instructions of the given address ranges (the hot path that the reader picks
from --blocks: e.g. the whole-piece branch of a load, one policy's encoder) and prints them per
value (V values a warp iteration) by pipe: ALU and IMAD issue at half the rate of fp32 on
sm_80 / sm_90 (64 lanes a clock an SM), shuffles at 32 lanes a clock an SM, conversions at 16;
an SM sub-partition issues one instruction a clock. docs/gpu.md uses it for the push stage.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_TARGET = re.compile(r"BRA\s+.*?0x([0-9a-f]+)")
_PRED = re.compile(r"^@!?U?P\w+\s+")

# Pipe of an opcode (its first dot-separated part) and the SM sub-partition clocks a warp
# instruction occupies it (sm_90: fp32 128 lanes a clock an SM, ALU / IMAD 64, shuffle 32,
# conversions 16).
_PIPES = {
    "fp32": ({"FADD", "FMUL", "FFMA"}, 1),
    "imad": ({"IMAD"}, 2),
    "shfl": ({"SHFL"}, 4),
    "conv": ({"F2F", "F2I", "I2F", "F2FP", "FRND", "MUFU"}, 8),
    "mem": ({"LDG", "STG", "LDS", "STS", "LDL", "STL", "ATOMG", "RED", "LDGSTS", "LDSM"}, 0),
    "ctrl": ({"BRA", "BSSY", "BSYNC", "WARPSYNC", "BAR", "EXIT", "NOP", "MEMBAR", "DEPBAR",
              "CALL", "RET", "YIELD"}, 0),
    "uniform": ({"ULDC", "UMOV", "UIADD3", "UIMAD", "USHF", "ULOP3", "UISETP", "S2UR", "R2UR",
                 "USEL", "UPRMT", "ULEA"}, 0),
    "mov": ({"MOV", "S2R", "CS2R"}, 0),
}


def pipe_of(instr: str) -> str:
    op = _PRED.sub("", instr).split()[0].split(".")[0]
    for name, (ops, _) in _PIPES.items():
        if op in ops:
            return name
    return "alu"


def read_sass(path: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """[(mangled kernel name, [(address, instruction)])] of OBJ (or of a cuobjdump text)."""
    try:
        text = open(path, encoding="utf-8").read()
        if "Function :" not in text:
            raise UnicodeDecodeError("", b"", 0, 1, "not SASS text")
    except UnicodeDecodeError:
        try:
            text = subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True,
                                  text=True).stdout
        except FileNotFoundError:
            sys.exit("sass_mix: cuobjdump is not on PATH (it comes with the CUDA toolkit); "
                     "or pass a text file of `cuobjdump -sass` output")
    kernels: list[tuple[str, list[tuple[int, str]]]] = []
    for line in text.splitlines():
        if "Function :" in line:
            kernels.append((line.split("Function :")[1].strip(), []))
            continue
        m = _INSTR.match(line)
        if m and kernels:
            kernels[-1][1].append((int(m.group(1), 16), m.group(2).strip()))
    return kernels


def demangle(names: list[str]) -> list[str]:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        return [n.replace("(anonymous namespace)::", "") for n in out]
    except (FileNotFoundError, subprocess.CalledProcessError):
        return names


def counts(instrs: list[str]) -> dict[str, int]:
    return dict(sorted(collections.Counter(_PRED.sub("", t).split()[0] for t in instrs).items()))


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) index of every loop: a branch back to an earlier address."""
    index = {a: i for i, (a, _) in enumerate(code)}
    found = []
    for i, (a, t) in enumerate(code):
        m = _TARGET.search(t)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in index:
            found.append((index[int(m.group(1), 16)], i))
    return sorted(found)


def blocks(code: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    leaders = {code[0][0]} if code else set()
    for i, (_, t) in enumerate(code):
        m = _TARGET.search(t)
        if m or "EXIT" in t or "BSYNC" in t:
            if m:
                leaders.add(int(m.group(1), 16))
            if i + 1 < len(code):
                leaders.add(code[i + 1][0])
    out: list[list[tuple[int, str]]] = []
    for a, t in code:
        if a in leaders or not out:
            out.append([])
        out[-1].append((a, t))
    return out


def parse_ranges(spec: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(x, 16) for x in r.split("-")) for r in spec.split(",")]
    except ValueError:
        sys.exit(f"sass_mix: ranges are hex LO-HI pairs separated by commas, got {spec!r}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("obj", help="object file / shared module with SASS, or cuobjdump -sass text")
    p.add_argument("--list", action="store_true", help="list the kernels, numbered from 1")
    p.add_argument("--kernel", type=int, help="kernel number (from --list)")
    p.add_argument("--blocks", metavar="LO-HI", help="print the basic blocks of this range")
    p.add_argument("--sum", metavar="RANGES", help="sum these address ranges (A-B,C-D)")
    p.add_argument("--values", type=int, default=1, help="values a warp iteration (for --sum)")
    args = p.parse_args(argv)
    kernels = read_sass(args.obj)
    if args.list or args.kernel is None:
        for i, name in enumerate(demangle([k[0] for k in kernels]), 1):
            print(f"{i:4d} {name}")
        return
    if not 1 <= args.kernel <= len(kernels):
        sys.exit(f"sass_mix: --kernel {args.kernel} is not in 1..{len(kernels)} (see --list)")
    name, code = kernels[args.kernel - 1]
    print(demangle([name])[0], f"({len(code)} instructions)")
    if args.blocks:
        (lo, hi), = parse_ranges(args.blocks)
        for b in blocks([(a, t) for a, t in code if lo <= a <= hi]):
            print(f"  {b[0][0]:#07x}-{b[-1][0]:#07x} {len(b):4d}  {counts([t for _, t in b])}")
    elif args.sum:
        ranges = parse_ranges(args.sum)
        picked = [t for a, t in code if any(lo <= a <= hi for lo, hi in ranges)]
        by_pipe = collections.Counter(pipe_of(t) for t in picked)
        v = args.values
        print(f"  {len(picked)} warp instructions for {v} values: {len(picked) / v:.3f} a value")
        print("  a value by pipe:", {k: round(n / v, 3) for k, n in sorted(by_pipe.items())})
        clocks = {k: c for k, (_, c) in _PIPES.items() if c}
        clocks["alu"] = 2  # integer add / logic / compare / select / shift: 64 lanes a clock
        print("  sub-partition clocks a value: issue", round(len(picked) / v, 3),
              {k: round(by_pipe[k] * c / v, 3) for k, c in sorted(clocks.items())})
    else:
        for first, last in loops(code):
            body = [t for _, t in code[first:last + 1]]
            hot = {k: n for k, n in counts(body).items()
                   if k.split(".")[0] in ("LDG", "STG", "LDL", "STL", "LDS", "STS", "SHFL",
                                          "BAR", "LDGSTS")}
            print(f"  loop {code[first][0]:#07x}-{code[last][0]:#07x}: {len(body)} instructions"
                  f"  {hot}")


if __name__ == "__main__":
    main()
