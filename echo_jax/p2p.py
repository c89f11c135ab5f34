"""Deprecated: the names this module gave live in `echo_jax.transports` (`DEPRECATED` names
each one's home). Each warns (DeprecationWarning) where it is read: `p2p_allreduce` and
`p2p_allreduce_compensated` are `echo_jax.transports.explicit`'s; `choose` is
`echo_jax.transports.resolve(config, axis_name, num_elements, honor_env=False)`;
`unavailable_reason` and `limit_reason` are `echo_jax.transports`'; the build and registry
queries, the custom-call targets and the CPU call's limits are `echo_jax.transports.cpu`'s; the
timeout, the FFI version checks and the shared limits are `echo_jax.transports.base`'s.
"""

from __future__ import annotations

import importlib
import warnings

from echo_jax import transports
from echo_jax.config import EchoConfig

#: Deprecated name -> the module that is its home (the name is the same there, except `choose`).
DEPRECATED = {
    "choose": "echo_jax.transports",
    **{name: "echo_jax.transports.explicit" for name in (
        "p2p_allreduce", "p2p_allreduce_compensated")},
    **{name: "echo_jax.transports" for name in ("unavailable_reason", "limit_reason")},
    **{name: "echo_jax.transports.base" for name in (
        "DEFAULT_TIMEOUT_S", "MAX_GROUP_SIZE", "MAX_SEGMENT_ELEMS", "TIMEOUT_ENV",
        "build_mismatch", "factor_operand", "runtime_ffi_api")},
    **{name: "echo_jax.transports.cpu" for name in (
        "DEBUG_FAILING_STAGES", "DTYPES", "MAX_RANKS", "POLICY_CODES", "TARGET", "TARGET_APPLIED",
        "TARGET_COMPENSATED", "available_platforms", "build_info", "debug_absent_rank",
        "debug_failing_rank", "registry_stats")},
}


def _choose(config: EchoConfig, axis_name=None, num_elements=None) -> str:
    """The transport a call runs: "p2p" where the custom call can run, else "xla" (the
    environment's ECHO_JAX_FORCE_XLA aside)."""
    return transports.resolve(config, axis_name, num_elements, honor_env=False)


def __getattr__(name):
    """The deprecated aliases (PEP 562): a DeprecationWarning naming the home, then the value."""
    home = DEPRECATED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "choose":
        replacement = f"{home}.resolve(config, axis_name, num_elements, honor_env=False)"
        value = _choose
    else:
        replacement = f"{home}.{name}"
        value = getattr(importlib.import_module(home), name)
    warnings.warn(f"echo_jax.p2p.{name} is deprecated: use {replacement}", DeprecationWarning,
                  stacklevel=2)
    return value


__all__: list = []
