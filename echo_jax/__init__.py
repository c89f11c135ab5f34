"""echo_jax: the Echo error-compensated 4-bit tensor-parallel all-reduce for JAX.

    import echo_jax as ej
    y = ej.echo_psum(x, "tp", config=ej.EchoConfig(bits=4))            # inside shard_map / vmap
    y, state = ej.echo_psum(x, "tp", config=cfg, state=ej.init_state(x))  # compensated
    y, state = ej.echo_psum(x, "tp", config=cfg, state=state, return_state=True)  # state or None

`echo_psum` takes what `lax.psum` takes (integer and bool leaves are summed exactly, a tuple of
axis names is one group); docs/design.md has the table ("The psum contract").

`import echo_jax` is light: it imports neither JAX nor a submodule. Each public name is loaded
from its module on first use (PEP 562), so a command-line tool can parse its arguments (and set
XLA_FLAGS) before JAX starts.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "EchoConfig": "echo_jax.config",
    "CompensatorState": "echo_jax.compensator",
    "QuantizedMoment": "echo_jax.compensator",
    "init_state": "echo_jax.compensator",
    "echo_psum": "echo_jax.collective",
    "resolve_transport": "echo_jax.collective",
    "segment_layout": "echo_jax.collective",
    "quantize_groups": "echo_jax.quant",
    "dequantize_groups": "echo_jax.quant",
    "quantize_dequantize": "echo_jax.quant",
    "hadamard_rotate": "echo_jax.rotation",
    "hadamard_unrotate": "echo_jax.rotation",
    "hadamard_signs": "echo_jax.rotation",
    "parse_site_config": "echo_jax.calibration",
    "site_config_label": "echo_jax.calibration",
    "site_wire_bits": "echo_jax.calibration",
    "choose_site_configs": "echo_jax.calibration",
    "row_parallel_matmul": "echo_jax.gspmd",
    "column_parallel_matmul": "echo_jax.gspmd",
    "state_for": "echo_jax.gspmd",
    "EchoShardingWarning": "echo_jax.partial_manual",
    "EchoMeshWarning": "echo_jax.gspmd",
    "EchoFallbackWarning": "echo_jax.transports",
}

__all__ = [
    "EchoConfig", "CompensatorState", "QuantizedMoment", "init_state", "echo_psum", "resolve_transport",
    "segment_layout", "quantize_groups", "dequantize_groups", "quantize_dequantize",
    "hadamard_rotate", "hadamard_unrotate", "hadamard_signs", "parse_site_config",
    "site_config_label", "site_wire_bits", "choose_site_configs", "row_parallel_matmul",
    "column_parallel_matmul", "state_for", "EchoShardingWarning", "EchoMeshWarning",
    "EchoFallbackWarning",
]


#: Submodules reachable as attributes (`ej.quant`), as when the package imported them eagerly.
_SUBMODULES = frozenset({
    "_compat", "calibration", "collective", "compensator", "config", "gspmd", "p2p", "p2p_cuda",
    "partial_manual", "policies", "quant", "rotation", "tp", "transports",
})


def __getattr__(name: str):
    """Loads a public name (or a submodule) on first access, then caches it here.

    Args:
      name: the attribute asked for.

    Returns:
      The object the name stands for.

    Raises:
      AttributeError: no such public name or submodule.
    """
    if name in _SUBMODULES:
        return importlib.import_module(f"echo_jax.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'echo_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
