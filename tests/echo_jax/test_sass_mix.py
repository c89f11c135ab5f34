"""ffi/tools/sass_mix.py: loops, basic blocks and the per-value mix of a chosen path, on a small
SASS listing in cuobjdump's format whose counts are known by hand."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# One kernel: a prologue, a loop 0x20-0x70 (branch back to 0x20), an epilogue.
SASS = """
\tcode for sm_90a
\t\tFunction : _Z6kernelPf
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                    /* 0x0000000000007919 */
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;      /* 0x0000000402047981 */
        /*0030*/                   FADD R4, R4, R5 ;                     /* 0x0000000504047221 */
        /*0040*/                   IMAD.MOV.U32 R6, RZ, RZ, R4 ;         /* 0x000000ffff067224 */
        /*0050*/                   SHFL.BFLY PT, R7, R6, 0x1, 0x1f ;     /* 0x0c201f0006077f89 */
        /*0060*/                   LOP3.LUT R8, R7, 0xff, RZ, 0xc0, !PT ; /* 0x000000ff07087812 */
        /*0070*/               @P0 BRA 0x20 ;                            /* 0xfffffffc00a80947 */
        /*0080*/                   STG.E desc[UR4][R2.64], R8 ;          /* 0x0000000802007986 */
        /*0090*/                   EXIT ;                                /* 0x000000000000794d */
"""


@pytest.fixture(scope="module")
def sass_mix():
    path = ROOT / "ffi" / "tools" / "sass_mix.py"
    spec = importlib.util.spec_from_file_location("sass_mix", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def listing(tmp_path):
    path = tmp_path / "k.sass"
    path.write_text(SASS)
    return str(path)


def test_reads_the_kernel_and_finds_its_loop(sass_mix, listing):
    (name, code), = sass_mix.read_sass(listing)
    assert name == "_Z6kernelPf" and len(code) == 10
    assert code[2] == (0x20, "LDG.E.128 R4, desc[UR4][R2.64]")
    assert [(code[a][0], code[b][0]) for a, b in sass_mix.loops(code)] == [(0x20, 0x70)]


def test_basic_blocks_split_at_targets_and_after_branches(sass_mix, listing):
    (_, code), = sass_mix.read_sass(listing)
    assert [(b[0][0], b[-1][0]) for b in sass_mix.blocks(code)] == [
        (0x00, 0x10), (0x20, 0x70), (0x80, 0x90)]


def test_sum_by_pipe_per_value(sass_mix, listing, capsys):
    sass_mix.main([listing, "--kernel", "1", "--sum", "20-70", "--values", "2"])
    out = capsys.readouterr().out
    assert "6 warp instructions for 2 values: 3.000 a value" in out
    # one each of memory, fp32, IMAD, shuffle, ALU (LOP3), control: 0.5 a value each
    assert ("{'alu': 0.5, 'ctrl': 0.5, 'fp32': 0.5, 'imad': 0.5, 'mem': 0.5, 'shfl': 0.5}"
            in out)
    # clocks of a sub-partition: fp32 1, ALU / IMAD 2, shuffle 4 a warp instruction
    clocks = next(line for line in out.splitlines() if "sub-partition clocks" in line)
    assert clocks.endswith(
        "issue 3.0 {'alu': 1.0, 'conv': 0.0, 'fp32': 0.5, 'imad': 1.0, 'shfl': 2.0}")


def test_predicated_instructions_count_by_their_opcode(sass_mix):
    assert sass_mix.pipe_of("@!P2 FFMA R1, R2, R3, R4") == "fp32"
    assert sass_mix.pipe_of("@P0 SHFL.BFLY PT, R7, R6, 0x1, 0x1f") == "shfl"
    assert sass_mix.pipe_of("@UP1 IMAD.WIDE.U32 R2, R3, 0x4, R4") == "imad"
    assert sass_mix.pipe_of("VIMNMX R1, R2, R3, PT") == "alu"


def test_bad_arguments_say_what_to_fix(sass_mix, listing):
    with pytest.raises(SystemExit, match="--kernel 5 is not in 1..1"):
        sass_mix.main([listing, "--kernel", "5"])
    with pytest.raises(SystemExit, match="hex LO-HI pairs"):
        sass_mix.main([listing, "--kernel", "1", "--sum", "20:70"])
