"""The host checks of ffi/tools (C++ programs that include the kernels' headers): build and run
one, and copies of the headers with one edit, the mutants a check must reject."""

import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
HEADERS = ("echo_common.h", "quant_fast.cuh")


def build_and_run(tool, include_dir, tmp_path, *args, flags=(), timeout=300):
    """Compiles ffi/tools/<tool> against the headers in include_dir and runs it with args."""
    exe = tmp_path / pathlib.Path(tool).stem
    subprocess.run([CXX, "-O2", "-ffp-contract=off", "-std=c++17", *flags, f"-I{include_dir}",
                    str(ROOT / "ffi" / "tools" / tool), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)


def mutated_headers(tmp_path, old, new, header="quant_fast.cuh"):
    """A copy of the headers in tmp_path/ffi with `old` replaced by `new` in `header`."""
    headers = tmp_path / "ffi"
    headers.mkdir()
    for name in HEADERS:
        shutil.copy(ROOT / "ffi" / name, headers / name)
    text = (headers / header).read_text()
    assert old in text, f"the mutant's target is gone from {header}: {old!r}"
    (headers / header).write_text(text.replace(old, new))
    return headers
