"""ffi/tools/ptxas_compare.py: two builds' ptxas reports, kernel by kernel (docs/install.md)."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "ffi" / "tools" / "ptxas_compare.py"
spec = importlib.util.spec_from_file_location("ptxas_compare", TOOL)
ptxas_compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ptxas_compare)


def report(regs: int, spill: int) -> str:
    """A ptxas -v report (nvcc's wording) of one kernel for sm_90a and sm_80."""
    out = []
    for arch in ("sm_90a", "sm_80"):
        out += [f"ptxas info    : Compiling entry function '_Z6kernelPf' for '{arch}'",
                "ptxas info    : Function properties for _Z6kernelPf",
                f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads",
                f"ptxas info    : Used {regs} registers, used 0 barriers, 380 bytes cmem[0]"]
    return "\n".join(out) + "\n"


def test_the_same_reports_pass_and_a_register_or_spill_change_fails(tmp_path, capsys):
    same, more_regs, spills = (tmp_path / n for n in ("a.log", "b.log", "c.log"))
    same.write_text(report(40, 0))
    more_regs.write_text(report(41, 0))
    spills.write_text(report(40, 8))
    assert ptxas_compare.main([str(same), str(same)]) == 0
    assert "sm_90a: 1 kernels, 40-40 registers, 0 spill; 0 differ" in capsys.readouterr().out
    assert ptxas_compare.main([str(same), str(more_regs)]) == 1
    assert "'regs': 40" in capsys.readouterr().out
    assert ptxas_compare.main([str(spills), str(same)]) == 1
    assert "sm_80: 1 kernels, 40-40 registers, 1 spill; 1 differ" in capsys.readouterr().out


def test_a_log_without_a_report_is_an_error(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("[1/2] Building CUDA object\n")
    with pytest.raises(SystemExit):
        ptxas_compare.main([str(empty), str(empty)])


def test_anonymous_namespaces_compare_across_translation_units(tmp_path):
    # nvcc names an anonymous namespace after the translation unit's path and contents: the same
    # kernel built from another checkout, or from a source split into headers, must still match.
    def named(tu: str) -> str:
        return report(40, 0).replace("_Z6kernelPf", f"_ZN4echo{tu}1kILi1EEEvPf")
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(named("46_GLOBAL__N__a49ba495_13_quant_cuda_cu_64d5c297"))
    b.write_text(named("44_GLOBAL__N__0123abcd_11_p2p_cuda_cu_89abcdef"))
    assert ptxas_compare.normalize("_ZN4echo46_GLOBAL__N__a49ba495_13_quant_cuda_cu_64d5c2971kv") \
        == "_ZN4echo_GLOBAL__N_1kv"
    assert ptxas_compare.main([str(a), str(b)]) == 0
