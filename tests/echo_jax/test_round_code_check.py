"""The conversion-free code arithmetic of the fast CUDA kernels, checked on the host.

`round_code` / `code_to_f32` (ffi/quant_fast.cuh) replace cvt.rni.s32.f32 + clamp and
cvt.rn.f32.u32 in every fast quantize, dequantize and all-reduce kernel. ffi/tools/
round_code_check.cc compares them with the conversions (round to nearest even, saturating) on
a stride of all fp32 bit patterns and on every tie of the code range, for the four encoders
(4 / 8 bits, asym and sym); it runs exhaustively by hand (see its header). Mutated headers show
the check can fail.
"""

import pytest
from host_tools import CXX, ROOT, build_and_run, mutated_headers

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler")


def run_check(include_dir, tmp_path, stride="65537"):
    return build_and_run("round_code_check.cc", include_dir, tmp_path, stride)


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
    r = run_check(mutated_headers(tmp_path, *MUTANTS[mutant]), tmp_path)
    assert r.returncode == 1 and "mismatches: 0" not in r.stdout, r.stdout
