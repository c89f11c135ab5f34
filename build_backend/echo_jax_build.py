"""The build backend of echo_jax: scikit-build-core's, with an editable install that adds no path.

scikit-build-core's editable wheel ("redirect" mode) holds `_editable_skbc_echo_jax.pth`: an
`import` line that installs an import hook serving the packages of `wheel.packages` from the
checkout, then the folder above each package, for static analysis tools. That folder is the
checkout's root, so every folder in it (`models`, `tests`, `ffi`, `docs`, ...) would become an
importable top-level name in the environment, ahead of a user's own package of that name. This
backend keeps the `.pth` file's `import` lines alone: the hook still serves every package of
`wheel.packages` (new modules included: it searches the package folders), and nothing else of
the checkout is importable. Scripts run from the checkout's root (`python -m models.train ...`,
pytest with its `pythonpath`) find its folders as before.

Every other hook is scikit-build-core's own (pyproject.toml: `build-backend`, `backend-path`).
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

from scikit_build_core import build as _skbc

build_sdist = _skbc.build_sdist
build_wheel = _skbc.build_wheel
get_requires_for_build_sdist = _skbc.get_requires_for_build_sdist
get_requires_for_build_wheel = _skbc.get_requires_for_build_wheel
get_requires_for_build_editable = _skbc.get_requires_for_build_editable

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
]

# scikit-build-core defines these only where its metadata is static (no dynamic fields).
for _name in ("prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable"):
    if hasattr(_skbc, _name):
        globals()[_name] = getattr(_skbc, _name)
        __all__.append(_name)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def import_lines_only(pth: bytes) -> bytes:
    """The `import` lines of an editable install's .pth file, without its sys.path entries."""
    lines = [line for line in pth.decode().splitlines() if line.startswith("import ")]
    return "".join(f"{line}\n" for line in lines).encode()


def strip_editable_paths(wheel_path: str) -> list[str]:
    """Rewrite the editable wheel in place: its `_editable_skbc_*.pth` keep their import lines.

    The wheel's RECORD gets the new hashes and sizes. Returns the sys.path entries removed.
    """
    with zipfile.ZipFile(wheel_path) as z:
        infos = z.infolist()
        contents = {i.filename: z.read(i) for i in infos}
    removed: list[str] = []
    changed: dict[str, bytes] = {}
    for name, data in contents.items():
        if "/" not in name and name.startswith("_editable_skbc_") and name.endswith(".pth"):
            kept = import_lines_only(data)
            removed += [line for line in data.decode().splitlines()
                        if line.strip() and not line.startswith("import ")]
            if kept != data:
                changed[name] = kept
    if not changed:
        return removed
    (record,) = [n for n in contents if n.endswith(".dist-info/RECORD")]
    lines = []
    for line in contents[record].decode().splitlines():
        name = line.rsplit(",", 2)[0]
        lines.append(_record_line(name, changed[name]) if name in changed else line)
    changed[record] = "".join(f"{line}\n" for line in lines).encode()
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for info in infos:
            out.writestr(info, changed.get(info.filename, contents[info.filename]))
    os.replace(tmp, wheel_path)
    return removed


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _skbc.build_editable(wheel_directory, config_settings, metadata_directory)
    removed = strip_editable_paths(os.path.join(wheel_directory, name))
    if removed:
        print(f"echo_jax: the editable install adds no sys.path entry (left out: "
              f"{', '.join(removed)}); only its packages are importable")
    return name
