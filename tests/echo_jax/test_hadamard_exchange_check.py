"""The half-exchange rotation of the fast CUDA kernels (ECHO_P2P_ROT_EXCHANGE), checked on the host.

ffi/tools/hadamard_exchange_check.cc runs quant_fast.cuh's hadamard_exchange_rotate / _unrotate
(the device functions themselves) on 32 host threads, one a lane, with the warp shuffle emulated,
stores each lane's values where the kernels store them (the plans' permuted lanes and pieces),
and compares with echo_common.h's reference rotation bit for bit, for every layout the rotated
all-reduce instances have (fp32 and 16-bit pieces, g = 32 .. 256, two and four pieces a lane),
on random groups and groups of signed zeros, cancelling pairs, infinities, NaN, subnormals and
huge values. The register-butterfly rotation runs through the same harness as its own check.
Mutated headers show the check can fail.
"""

import pytest
from host_tools import CXX, ROOT, build_and_run, mutated_headers

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a host C++ compiler")


def run_check(include_dir, tmp_path, sets="8"):
    return build_and_run("hadamard_exchange_check.cc", include_dir, tmp_path, sets,
                         flags=("-pthread",))


@pytest.mark.slow   # a host build of the CUDA device functions, run on 8 threads
def test_half_exchanges_give_the_reference_bits(tmp_path):
    r = run_check(ROOT / "ffi", tmp_path)
    assert r.returncode == 0 and "mismatches: 0" in r.stdout, r.stdout
    # every layout ran, both ways, with a count of its own
    assert r.stdout.count("half exchanges") == 12 and r.stdout.count("butterflies") == 12
    assert r.stdout.count(": 0 mismatches") == 24


MUTANTS = {
    # The sum and the difference written to each other's slots.
    "outputs swapped": ("const float u0 = s2 ? cs : 1.0f, w0 = s2 ? -cs : 1.0f;",
                        "const float u0 = s2 ? 1.0f : cs, w0 = s2 ? 1.0f : -cs;"),
    # The pair exchanges its even slots instead of the odd ones.
    "even slots exchanged": ("for (int m = 1; m < L::kLoads; m += 2)",
                             "for (int m = 0; m < L::kLoads; m += 2)"),
    # The swizzle before a butterfly ignored: the difference of a swizzled lane has its sign wrong.
    "swizzle ignored": ("const float cs = swizzle_of(kBefore, j) ? -1.0f : 1.0f;",
                        "const float cs = 1.0f;"),
    # low - high as -(p0 - p1) on swizzled lanes: the same value but -0 for +0 on a cancellation.
    "difference negated": ("v[m + 1][t] = fma_rn(u1, p0, mul_rn(w1, p1));",
                           "v[m + 1][t] = s2 ? add_rn(p0, p1) : mul_rn(cs, sub_rn(p0, p1));"),
    # The input loads without the first exchange's swizzle.
    "input unswizzled": ("    return m ^ swizzle_of(bit, j);\n  }\n  // Where lane j's slot m of "
                         "the rotated group",
                         "    return m;\n  }\n  // Where lane j's slot m of the rotated group"),
}


@pytest.mark.slow   # the mutation check of the host check: with the slow set
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_check_rejects_a_broken_exchange(tmp_path, mutant):
    r = run_check(mutated_headers(tmp_path, *MUTANTS[mutant]), tmp_path, sets="4")
    assert r.returncode == 1 and "mismatches: 0" not in r.stdout, r.stdout
