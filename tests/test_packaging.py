"""What the install claims and does.

* The packages `echo_jax` and `echo_jax_tools`, no generic top-level name: a user's project
  with its own package named `models` (a common name) imports it, and echo_jax, whatever is
  installed: the editable install of this environment (fast test) and a wheel built from this
  checkout, installed into a folder of its own (slow: it compiles the CPU handler); the editable install puts no folder of
  the checkout on sys.path (build_backend/echo_jax_build.py).
* The CUDA decisions of CMakeLists.txt, from configure-only runs: the architectures of the GPUs
  nvidia-smi lists (a fake one on the PATH), none without a GPU, the overrides; a system nvcc
  outside the PATH is not picked up.
* The dependencies: the library's are what the collective and its layers need; the models' and
  benchmarks' packages are behind the extra `models`, and no module of echo_jax imports them when
  it is imported.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

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


# --- the editable install -----------------------------------------------------------------------

#: Folders of the checkout that must not be importable from elsewhere.
CHECKOUT_FOLDERS = ("models", "tests", "ffi", "docs", "build_backend")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def test_the_install_puts_no_checkout_folder_on_sys_path(tmp_path):
    """From a folder outside the checkout, echo_jax imports and `models`, `tests`, `ffi` do not
    (the editable install's .pth holds its import line alone)."""
    script = (
        "import importlib.util, json, sys\n"
        "import echo_jax\n"
        f"names = {CHECKOUT_FOLDERS!r}\n"
        "found = {n: importlib.util.find_spec(n) is not None for n in names}\n"
        "print(json.dumps({'found': found, 'path': sys.path}))\n")
    out = _run([sys.executable, "-c", script], cwd=tmp_path, env=_clean_env())
    import json
    report = json.loads(out.strip().splitlines()[-1])
    assert not any(report["found"].values()), report["found"]
    assert str(REPO) not in report["path"], report["path"]


def _backend():
    pytest.importorskip("scikit_build_core", reason="the build backend wraps scikit-build-core")
    spec = importlib.util.spec_from_file_location(
        "echo_jax_build", REPO / "build_backend" / "echo_jax_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def test_the_build_backend_keeps_the_editable_pth_import_lines_alone(tmp_path):
    """The editable wheel's .pth loses its sys.path entries (the checkout's root) and RECORD
    gets the new hash and size; every other file is as scikit-build-core wrote it."""
    backend = _backend()
    assert set(backend.__all__) >= {"build_editable", "build_wheel", "build_sdist"}
    pth = b"import _editable_skbc_echo_jax\n/checkout\n"
    hook = b"install({})\n"
    wheel = tmp_path / "echo_jax-0.1.0-cp312-cp312-linux_x86_64.whl"
    record = "echo_jax-0.1.0.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("_editable_skbc_echo_jax.pth", pth)
        z.writestr("_editable_skbc_echo_jax.py", hook)
        z.writestr(record, "\n".join([_record("_editable_skbc_echo_jax.pth", pth),
                                      _record("_editable_skbc_echo_jax.py", hook),
                                      f"{record},,"]) + "\n")
    assert backend.strip_editable_paths(str(wheel)) == ["/checkout"]
    with zipfile.ZipFile(wheel) as z:
        new_pth = z.read("_editable_skbc_echo_jax.pth")
        assert new_pth == b"import _editable_skbc_echo_jax\n"
        assert z.read("_editable_skbc_echo_jax.py") == hook
        lines = z.read(record).decode().splitlines()
    assert lines == [_record("_editable_skbc_echo_jax.pth", new_pth),
                     _record("_editable_skbc_echo_jax.py", hook), f"{record},,"]
    assert backend.strip_editable_paths(str(wheel)) == []     # nothing left to strip


def test_the_editable_install_is_configured_through_the_backend():
    build = PYPROJECT["build-system"]
    assert build["build-backend"] == "echo_jax_build"
    assert build["backend-path"] == ["build_backend"]
    assert PYPROJECT["tool"]["scikit-build"]["editable"]["mode"] == "redirect"


# --- CMakeLists.txt's CUDA decisions ---------------------------------------------------------------

NVCC = shutil.which("nvcc")
CMAKE = shutil.which("cmake")
needs_cmake = pytest.mark.skipif(CMAKE is None, reason="needs cmake")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc on the PATH")


def _fake_nvidia_smi(folder: Path, caps: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    lines = "".join(f"{c}\n" for c in caps)
    smi.write_text(f"#!/bin/sh\nprintf '{lines}'\n")
    smi.chmod(0o755)
    return folder


def _configure(tmp_path: Path, path: str, *defines: str, **env) -> str:
    """A configure-only run of CMakeLists.txt; its `echo_jax:` lines."""
    pytest.importorskip("nanobind", reason="the configure needs nanobind")
    environ = {k: v for k, v in os.environ.items()
               if k not in ("ECHO_JAX_CUDA_ARCHITECTURES", "CUDACXX", "CMAKE_PREFIX_PATH")}
    environ.update(env, PATH=path)
    out = subprocess.run(
        [CMAKE, "-S", str(REPO), "-B", str(tmp_path / "build"),
         f"-DPython_EXECUTABLE={sys.executable}", *defines],
        env=environ, capture_output=True, text=True, timeout=300)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "echo_jax:" in line]
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    return "\n".join(lines)


def _built_for(lines: str) -> str | None:
    m = re.search(r"building the CUDA handlers with CUDA \S+ \(.*?\) for (\S+)", lines)
    return m and m.group(1)


@needs_cmake
@needs_nvcc
@pytest.mark.grid("h100")
@pytest.mark.parametrize("caps, archs", [
    (["9.0"], "90a-real"),
    (["8.6", "9.0", "9.0", "10.0", "12.0", "10.3"], "80-real;90a-real;100a-real;120-real;80-virtual"),
], ids=["h100", "mixed"])
def test_the_source_install_builds_for_the_gpus_it_finds(tmp_path, caps, archs):
    fake = _fake_nvidia_smi(tmp_path / "bin", caps)
    lines = _configure(tmp_path, f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert _built_for(lines) == archs, lines
    assert "the GPUs of this machine" in lines


@needs_cmake
@needs_nvcc
def test_without_a_gpu_the_source_install_builds_no_cuda_and_says_how(tmp_path):
    fake = _fake_nvidia_smi(tmp_path / "bin", [])
    lines = _configure(tmp_path, f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert _built_for(lines) is None, lines
    (line,) = [l for l in lines.splitlines() if "no GPU found" in l]
    assert "ECHO_JAX_CUDA_ARCHITECTURES=wheel" in line and ".ci/wheel" in line, line


@needs_cmake
@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("env, defines, archs", [
    ({"ECHO_JAX_CUDA_ARCHITECTURES": "80-real"}, (), "80-real"),
    ({"ECHO_JAX_CUDA_ARCHITECTURES": "wheel"}, (),
     "80-real;90a-real;100a-real;120-real;80-virtual"),
    ({"ECHO_JAX_CUDA_ARCHITECTURES": "80-real"}, ("-DCMAKE_CUDA_ARCHITECTURES=120-real",),
     "120-real"),
], ids=["env", "wheel", "cmake-wins"])
def test_the_architectures_can_be_named(tmp_path, env, defines, archs):
    fake = _fake_nvidia_smi(tmp_path / "bin", ["9.0"])
    lines = _configure(tmp_path, f"{fake}{os.pathsep}{os.environ['PATH']}", *defines, **env)
    assert _built_for(lines) == archs, lines


@needs_cmake
@needs_nvcc
def test_a_system_nvcc_outside_the_path_is_not_picked_up(tmp_path):
    """An nvcc under one of CMake's default prefixes (CMAKE_PREFIX_PATH here, /usr/local on a
    machine with a system toolkit), its folder off the PATH: the build does not use it (it takes
    pip's toolkit where this environment has one, else builds the CPU handler alone)."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "nvcc").symlink_to(NVCC)
    fake = _fake_nvidia_smi(tmp_path / "bin", ["9.0"])
    path = os.pathsep.join([str(fake)] + [d for d in os.environ["PATH"].split(os.pathsep)
                                          if d and not os.path.exists(os.path.join(d, "nvcc"))])
    lines = _configure(tmp_path, path, CMAKE_PREFIX_PATH=str(prefix))
    assert str(prefix) not in lines and "(nvcc on the PATH," not in lines, lines
    assert ("no CUDA compiler found" in lines) or ("pip's CUDA toolkit" in lines), lines


@needs_cmake
def test_cuda_required_fails_the_configure_without_cuda(tmp_path):
    pytest.importorskip("nanobind", reason="the configure needs nanobind")
    out = subprocess.run(
        [CMAKE, "-S", str(REPO), "-B", str(tmp_path / "build"),
         f"-DPython_EXECUTABLE={sys.executable}", "-DECHO_JAX_CUDA=OFF",
         "-DECHO_JAX_CUDA_REQUIRED=ON"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "ECHO_JAX_CUDA_REQUIRED=ON and the CUDA handlers would not be built" in \
        " ".join((out.stdout + out.stderr).split())


# --- the dependencies ---------------------------------------------------------------------------

#: What the models, the benchmarks, their plots and the demo's progress bar need.
MODELS_PACKAGES = {"optax": "optax", "orbax-checkpoint": "orbax", "tokenizers": "tokenizers",
                   "gguf": "gguf", "matplotlib": "matplotlib", "tqdm": "tqdm"}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")


def test_the_library_depends_on_what_the_collective_and_layers_need():
    project = PYPROJECT["project"]
    assert {_name(r) for r in project["dependencies"]} == {"jax", "jaxlib", "flax", "numpy"}
    extras = project["optional-dependencies"]
    assert {_name(r) for r in extras["models"]} == set(MODELS_PACKAGES)
    assert "echo_jax[models]" in extras["test"]     # the suite covers the models


def _import_time_imports(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported (not inside a function)."""
    names: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names.update(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names.add(child.module.split(".")[0])
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def test_no_library_module_imports_the_models_packages_when_imported():
    packages = [REPO / p for p in PYPROJECT["tool"]["scikit-build"]["wheel"]["packages"]]
    offenders = {
        str(f.relative_to(REPO)): sorted(_import_time_imports(f) & set(MODELS_PACKAGES.values()))
        for p in packages for f in sorted(p.rglob("*.py"))}
    assert not {k: v for k, v in offenders.items() if v}, offenders
