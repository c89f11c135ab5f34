"""echo_jax_tools.provenance: the "command", "commit" and "device" of every results JSON.

Pure Python, no device: the devices are stand-ins with a kind and a platform.
"""

import importlib.util
import re
import shutil
from types import SimpleNamespace

import pytest

from echo_jax_tools import projection, provenance


def _devices(kind, platform, n):
    return [SimpleNamespace(device_kind=kind, platform=platform, id=i) for i in range(n)]


def test_command_is_the_module_and_its_arguments_as_a_shell_takes_them():
    assert provenance.command("echo_jax_tools.bench", ["kernels", "--sizes", "256MB"]) == \
        "python -m echo_jax_tools.bench kernels --sizes 256MB"
    # An argument with a space or a shell character is quoted: the line runs as recorded.
    assert provenance.command("models.experiments", ["pretrain-table", "a.json", "--labels",
                                                     "16-bit (exact)"]) == \
        "python -m models.experiments pretrain-table a.json --labels '16-bit (exact)'"
    assert provenance.command("models.train", []) == "python -m models.train"
    assert provenance.command("models.train", None) is None


def test_command_writes_folder_flags_as_dir():
    argv = ["--cache-dir", "/a/b c", "--tokens=/t", "--json", "out.json", "--tokens"]
    assert provenance.command("models.eval", argv, ("--cache-dir", "--tokens")) == \
        "python -m models.eval --cache-dir DIR --tokens=DIR --json out.json --tokens"


def test_device_name_kind_count_and_platform():
    assert provenance.device_name(_devices("NVIDIA H200", "gpu", 1)) == "NVIDIA H200"
    assert provenance.device_name(_devices("cpu", "cpu", 1)) == "cpu"
    assert provenance.device_name(_devices("cpu", "cpu", 8)) == "cpu (8 devices)"
    assert provenance.device_name(_devices("NVIDIA H100 80GB HBM3", "gpu", 4)) == \
        "NVIDIA H100 80GB HBM3 (4 gpu devices)"
    mixed = _devices("NVIDIA H200", "gpu", 2) + _devices("NVIDIA H100 80GB HBM3", "gpu", 1)
    assert provenance.device_name(mixed) == \
        "NVIDIA H200 (2 gpu devices), NVIDIA H100 80GB HBM3 (1 gpu device)"
    with pytest.raises(ValueError):
        provenance.device_name([])


def test_record_has_the_three_keys_in_order():
    rec = provenance.record("python -m m", _devices("cpu", "cpu", 2))
    assert list(rec) == ["command", "commit", "device"]
    assert rec["command"] == "python -m m" and rec["device"] == "cpu (2 devices)"
    # From this checkout: a short hash, "-dirty" with uncommitted changes outside results/.
    assert rec["commit"] is None or re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", rec["commit"])
    assert provenance.record(None, "none (no device)")["device"] == "none (no device)"
    # The projection computes nothing on a device and says so; its commit is the same helper's.
    proj = projection.provenance(["project", "--json", "p.json"])
    assert proj["command"] == "python -m echo_jax_tools.bench project --json p.json"
    assert proj["device"] == projection.NO_DEVICE and proj["commit"] == rec["commit"]
    assert projection.source_commit is provenance.source_commit


def test_source_commit_is_none_outside_a_checkout(tmp_path):
    folder = tmp_path / "echo_jax_tools"
    folder.mkdir()
    shutil.copy(provenance.__file__, folder / "provenance.py")
    spec = importlib.util.spec_from_file_location("copied_provenance", folder / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.source_commit() is None
