"""Deprecated alias of `echo_jax.transports.cuda`: import that module instead.

Importing this one warns (DeprecationWarning) and gives the same functions: `rank_allreduce`,
`virtual_allreduce`, `quantize` / `dequantize`, `build_info`, `available`, `register`,
`mesh_groups`, `timeout_ms`, `MAX_RANKS`, `TIMEOUT_ENV`, `POLICY_CODES`, `_module`.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

from echo_jax.transports.cuda import (MAX_RANKS, POLICY_CODES, TIMEOUT_ENV,  # noqa: F401
                                      _module, available, build_info, dequantize, mesh_groups,
                                      quantize, rank_allreduce, register, timeout_ms,
                                      virtual_allreduce)

_IMPORT_FRAMES = ("<frozen importlib", os.path.dirname(importlib.__file__) + os.sep)


def _warn_the_importer(message: str) -> None:
    """A DeprecationWarning attributed to the line that imports this module: the frames of the
    import system and of the package's lazy `__getattr__` (`from echo_jax import p2p_cuda`) are
    skipped, so that the default filters show it where that line is in __main__, and pytest lists
    it under the test module that imports."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_globals.get("__name__") in (__name__, "echo_jax")
                                 or frame.f_code.co_filename.startswith(_IMPORT_FRAMES)):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return
    warnings.warn_explicit(message, DeprecationWarning, frame.f_code.co_filename,
                           frame.f_lineno, module=frame.f_globals.get("__name__", "<unknown>"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))


_warn_the_importer("echo_jax.p2p_cuda is deprecated: import echo_jax.transports.cuda (the same "
                   "functions)")

__all__ = ["available", "build_info", "register", "quantize", "dequantize", "virtual_allreduce",
           "rank_allreduce", "mesh_groups", "timeout_ms", "MAX_RANKS", "TIMEOUT_ENV",
           "POLICY_CODES"]
