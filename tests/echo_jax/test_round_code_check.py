"""The conversion-free code arithmetic of the fast CUDA kernels, checked on the host.

`round_code` / `code_to_f32` (ffi/quant_fast.cuh) replace cvt.rni.s32.f32 + clamp and
cvt.rn.f32.u32 in every fast quantize, dequantize and all-reduce kernel. ffi/tools/
round_code_check.cc compares them with the conversions (round to nearest even, saturating) on
a stride of all fp32 bit patterns and on every tie of the code range, for the four encoders
(4 / 8 bits, asym and sym); it runs exhaustively by hand (see its header). Mutated headers show
the check can fail.
"""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler")


def run_check(include_dir, tmp_path, stride="65537"):
    exe = tmp_path / "round_code_check"
    subprocess.run([CXX, "-O2", "-ffp-contract=off", "-std=c++17", f"-I{include_dir}",
                    str(ROOT / "ffi" / "tools" / "round_code_check.cc"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return subprocess.run([str(exe), stride], capture_output=True, text=True, timeout=300)


def test_round_code_matches_the_conversions(tmp_path):
    r = run_check(ROOT / "ffi", tmp_path)
    assert r.returncode == 0 and "mismatches: 0" in r.stdout, r.stdout


MUTANTS = {
    # An odd constant sends ties (and 0) to the wrong code.
    "odd magic": ("constexpr float kRoundMagic = 12582912.0f;",
                  "constexpr float kRoundMagic = 12582913.0f;"),
    # No upper clamp: codes above the top level spill into the next code's bits.
    "no upper clamp": ("add_rn(fminf(fmaxf(v, lo), hi), magic_off)",
                       "add_rn(fmaxf(v, lo), magic_off)"),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_check_rejects_a_broken_round_code(tmp_path, mutant):
    old, new = MUTANTS[mutant]
    headers = tmp_path / "ffi"
    headers.mkdir()
    for name in ("echo_common.h", "quant_fast.cuh"):
        shutil.copy(ROOT / "ffi" / name, headers / name)
    text = (headers / "quant_fast.cuh").read_text()
    assert old in text, f"the mutant's target is gone from quant_fast.cuh: {old!r}"
    (headers / "quant_fast.cuh").write_text(text.replace(old, new))
    r = run_check(headers, tmp_path)
    assert r.returncode == 1 and "mismatches: 0" not in r.stdout, r.stdout
