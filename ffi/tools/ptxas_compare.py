"""Compare the ptxas reports of two builds of the CUDA module, kernel by kernel.

Build each with `-Xptxas=-v` (e.g. `CUDA_FLAGS=-Xptxas=-v .ci/wheel`, or CMake with
`-DCMAKE_CUDA_FLAGS=-Xptxas=-v`) and keep the build logs; then

    python ffi/tools/ptxas_compare.py system.log pip.log

prints, per GPU architecture, the number of kernels, their register range, how many spill, and
every (kernel, architecture) whose registers, stack frame or spills differ between the two logs.
Exits 1 when the two builds differ in any of them or in the set of kernels.

Kernels in an anonymous namespace carry nvcc's name for it, which hashes the translation unit's
path and contents (`_GLOBAL__N__<hash>_<len>_<file>_<hash>`); it is replaced by `_GLOBAL__N_`, so
two builds of different checkouts, or of a source split into headers, compare kernel by kernel.
"""

from __future__ import annotations

import argparse
import re
import sys

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")
ANON = re.compile(r"_GLOBAL__N__[0-9a-f]{8}_(\d+)_")


def normalize(name: str) -> str:
    """`name` with every nvcc anonymous-namespace identifier, and the length that prefixes it in
    the mangled name, replaced by `_GLOBAL__N_`."""
    out, pos = [], 0
    for m in ANON.finditer(name):
        if m.start() < pos:
            continue
        file_len = int(m.group(1))
        tail = re.match(r"_[0-9a-f]{8}", name[m.end() + file_len:])
        if tail is None:
            continue
        end = m.end() + file_len + tail.end()
        prefix = str(end - m.start())  # the identifier's length, as the mangled name spells it
        if not name[:m.start()].endswith(prefix):
            continue
        out += [name[pos:m.start() - len(prefix)], "_GLOBAL__N_"]
        pos = end
    return "".join(out) + name[pos:]


def parse(path: str) -> dict:
    """{(kernel, arch): {"regs", "stack", "spill_stores", "spill_loads"}} of one ptxas -v log."""
    report, current = {}, None
    with open(path, errors="replace") as f:
        for line in f:
            if m := ENTRY.search(line):
                current = (normalize(m.group(1)), m.group(2))
                report[current] = {}
            elif current is not None and (m := FRAME.search(line)):
                report[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                       spill_loads=int(m.group(3)))
            elif current is not None and (m := REGS.search(line)):
                report[current]["regs"] = int(m.group(1))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", help="build log with the ptxas -v report (e.g. the system toolkit's)")
    parser.add_argument("second", help="the other build log (e.g. pip's toolkit's)")
    args = parser.parse_args(argv)
    a, b = parse(args.first), parse(args.second)
    if not a:
        parser.error(f"{args.first}: no ptxas report (build with -Xptxas=-v)")
    differ = sorted(set(a) ^ set(b))
    print(f"{len(a)} (kernel, architecture) reports vs {len(b)}; "
          f"{'the same' if not differ else len(differ)} {'set' if not differ else 'only in one'}")
    for arch in sorted({arch for _, arch in a}):
        mine = {k: v for k, v in a.items() if k[1] == arch}
        changed = [k for k in mine if k in b and b[k] != mine[k]]
        differ += changed
        regs = [v["regs"] for v in mine.values()]
        spilling = sum(1 for v in mine.values() if v.get("spill_stores") or v.get("spill_loads"))
        print(f"{arch}: {len(mine)} kernels, {min(regs)}-{max(regs)} registers, {spilling} spill; "
              f"{len(changed)} differ")
        for k in changed[:10]:
            print(f"  {k[0]}: {mine[k]} vs {b[k]}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
