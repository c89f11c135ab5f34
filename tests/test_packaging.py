"""What the install claims: the packages `echo_jax` and `echo_jax_tools`, no generic top-level name.

A user's project with its own package named `models` (a common name) imports it, and echo_jax,
whatever is installed: the editable install of this environment (fast test) and a wheel built from
this checkout, installed into a folder of its own (slow: it compiles the CPU handler).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: A user's project: its own `models` package, and a script importing it and echo_jax.
USER_MODELS = "MARKER = 'the user models package'\n"
USER_SCRIPT = """
import models
import echo_jax
from echo_jax.transports import cpu
assert models.MARKER == 'the user models package', models.__file__
assert cpu.build_info(), 'echo_jax._ffi did not load'
print('models from', models.__file__)
print('echo_jax from', echo_jax.__file__)
"""


def _user_project(tmp_path: Path) -> Path:
    project = tmp_path / "user_project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text(USER_MODELS)
    (project / "main.py").write_text(USER_SCRIPT)
    return project


def _run(args, cwd: Path, env=None):
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_a_user_models_package_is_found_next_to_the_installed_echo_jax(tmp_path):
    project = _user_project(tmp_path)
    out = _run([sys.executable, "main.py"], cwd=project)
    assert f"models from {project / 'models' / '__init__.py'}" in out


@pytest.mark.slow
def test_the_wheel_holds_echo_jax_and_its_tools_and_installs_next_to_a_user_models_package(
        tmp_path):
    pytest.importorskip("scikit_build_core", reason="building the wheel needs scikit-build-core")
    pytest.importorskip("nanobind", reason="building the wheel needs nanobind")
    dist = tmp_path / "dist"
    # The CPU handler alone (the CUDA build is .ci/wheel's), against this environment's jaxlib.
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
          "-w", str(dist), "-C", "cmake.define.ECHO_JAX_CUDA=OFF",
          "-C", f"build-dir={tmp_path / 'build'}", str(REPO)], cwd=tmp_path)
    (wheel,) = dist.glob("echo_jax-*.whl")
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"echo_jax", "echo_jax_tools"}, \
        sorted(top)

    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
          str(wheel)], cwd=tmp_path)
    project = _user_project(tmp_path)
    # -S: no .pth files, so the editable install of this environment stays out of the way; its
    # site-packages comes after the wheel's folder for jax and the rest.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), sysconfig.get_paths()["purelib"]]))
    out = _run([sys.executable, "-S", "main.py"], cwd=project, env=env)
    assert f"models from {project / 'models' / '__init__.py'}" in out
    assert f"echo_jax from {site / 'echo_jax' / '__init__.py'}" in out
