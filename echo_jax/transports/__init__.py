"""The transports of the Echo all-reduce, behind one small interface, and the one choice of them.

A transport is a module with

* ``NAME``: the value of `EchoConfig.transport` that names it ("xla", or "p2p" for both custom
  calls);
* ``unavailable_reason(axis_name=None)``: None where it can run in this tracing context, else a
  sentence that says why not;
* ``limit_reason(config, num_elements, num_ranks)``: None where the call is within its size
  limits, else a sentence;
* ``allreduce(x_flat, axis, num_ranks, config, factor=None)``: the quantized all-reduce of a flat
  contribution (float32, bfloat16 or float16), the sum in x's dtype, the same bits on every
  transport; with ``config.rotation == "hadamard"`` rotated inside the call (the bits of
  `xla.rotated_allreduce`: pad to whole groups, rotate, all-reduce, rotate back, cut);
* optionally ``allreduce_compensated(x_flat, m1, m2, axis, num_ranks, config, factor=None)``:
  Algorithm 1 of the Echo paper fused into the call, rotated like ``allreduce`` between the
  apply and the update steps, with ``FUSED_STATE_DTYPES`` (default ("float32",)) the state
  dtypes it takes (`fused_state_dtypes`). `echo_psum` takes the fused path where the chosen
  transport has it (and `collective.fused_compensation` allows it);
* optionally ``allreduce_applied(x_flat, m1, m2, axis, num_ranks, config, factor=None)``: the
  apply step alone fused into the call's entry pass, y returned, m1 and m2 only read
  (`EchoConfig.state_update="separate"`, `has_fused_apply`);
* optionally ``fused_rotation(config)``: whether the call rotates by itself for this config
  (`has_fused_rotation`; a transport without it counts as False). Where it does not,
  `echo_psum` rotates in JAX around it and passes it ``rotation="none"``.

The transports: `xla` (pure JAX, everywhere, the reference), `cpu` (the XLA FFI custom call of
`echo_jax._ffi`, host threads over shared memory) and `cuda` (the CUDA custom calls of
`echo_jax._ffi_cuda`, one GPU per rank). `select` is the one place that decides which runs.
"""

from __future__ import annotations

import os

from jax import lax

from echo_jax.config import EchoConfig
from echo_jax.transports import base, cpu, cuda, xla

#: Environment switch: set to 1 to force the pure-JAX transport everywhere (`echo_psum`).
FORCE_XLA_ENV = "ECHO_JAX_FORCE_XLA"


def custom_call():
    """The custom-call transport of the platform a call traced here runs on: `cuda` on NVIDIA
    GPUs, else `cpu`."""
    return cuda if base.on_gpu() else cpu


def unavailable_reason(axis_name=None) -> str | None:
    """Why the "p2p" custom call of this platform cannot run here (None when it can).

    Args:
      axis_name: the axis to reduce over, if known; without it only the context is checked.
    """
    return custom_call().unavailable_reason(axis_name)


def limit_reason(config: EchoConfig, num_elements: int, num_ranks: int) -> str | None:
    """Why the size limits of this platform's custom call rule a call out (None when within).

    Args:
      config: the call's EchoConfig (its group size).
      num_elements: elements of one rank's flat contribution.
      num_ranks: the size P of the reduced axis.
    """
    return custom_call().limit_reason(config, num_elements, num_ranks)


def select(config: EchoConfig, axis_name=None, num_elements=None, *, num_ranks=None,
           transport=None, where=None, honor_env=True):
    """The transport a call runs here: the one decision of "auto", "p2p" and the kill switch.

    "xla" runs "xla". "p2p" and "auto" run this platform's custom call where its
    `unavailable_reason` (and, with the axis and the size known, its `limit_reason`) is None;
    elsewhere "auto" runs "xla" (the same bits) and "p2p" raises.

    Args:
      config: the call's EchoConfig.
      axis_name: the axis to reduce over, if known.
      num_elements: elements of one rank's flat contribution, if known (with the axis, the size
        limits are checked too).
      num_ranks: the axis size, if known (default: `lax.axis_size(axis_name)`).
      transport: "auto", "p2p" or "xla" instead of `config.transport`.
      where: a prefix for the error message (the public function called).
      honor_env: whether ECHO_JAX_FORCE_XLA=1 forces "xla" (`echo_psum` honours it; the
        explicit `echo_jax.p2p` functions do not).

    Returns:
      The transport module (`xla`, `cpu` or `cuda`).

    Raises:
      ValueError: the transport is "p2p" but the custom call cannot run here (says why).
    """
    requested = config.transport if transport is None else transport
    if honor_env and os.environ.get(FORCE_XLA_ENV, "") not in ("", "0"):
        return xla
    if requested == "xla":
        return xla
    chosen = custom_call()
    reason = chosen.unavailable_reason(axis_name)
    if reason is None and axis_name is not None and num_elements is not None:
        ranks = lax.axis_size(axis_name) if num_ranks is None else int(num_ranks)
        reason = chosen.limit_reason(config, int(num_elements), ranks)
    if reason is None:
        return chosen
    if requested == "p2p":
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}EchoConfig.transport='p2p' cannot run here: {reason}. Use "
                         "transport='auto' (falls back to 'xla') or transport='xla'.")
    return xla


def resolve(config: EchoConfig, axis_name=None, num_elements=None, **kwargs) -> str:
    """The name ("xla" or "p2p") of the transport `select` chooses (same arguments)."""
    return select(config, axis_name, num_elements, **kwargs).NAME


def has_fused_compensation(transport) -> bool:
    """Whether a transport module fuses the compensated all-reduce (`allreduce_compensated`)."""
    return callable(getattr(transport, "allreduce_compensated", None))


def has_fused_apply(transport) -> bool:
    """Whether a transport module fuses the apply step alone into its call (`allreduce_applied`,
    for `EchoConfig.state_update="separate"`); it takes the state dtypes of its compensated
    call (`fused_state_dtypes`)."""
    return has_fused_compensation(transport) and callable(
        getattr(transport, "allreduce_applied", None))


def fused_state_dtypes(transport) -> tuple[str, ...]:
    """The compensator state dtypes (`EchoConfig.state_dtype`) a transport module's fused
    compensated call takes: its ``FUSED_STATE_DTYPES``, ("float32",) when it has none, () when
    it has no fused call."""
    if not has_fused_compensation(transport):
        return ()
    return tuple(getattr(transport, "FUSED_STATE_DTYPES", ("float32",)))


def has_fused_rotation(transport, config: EchoConfig) -> bool:
    """Whether a transport module's calls rotate by themselves for this config (its
    ``fused_rotation(config)``; False for a transport without one). `echo_psum` hands the
    rotation to the call only where this holds (`collective.fused_rotation`).

    Args:
      transport: a transport module (`select`'s result).
      config: the call's EchoConfig.
    """
    fused = getattr(transport, "fused_rotation", None)
    return bool(fused(config)) if callable(fused) else False


__all__ = ["select", "resolve", "custom_call", "unavailable_reason", "limit_reason",
           "has_fused_compensation", "has_fused_apply", "fused_state_dtypes",
           "has_fused_rotation", "FORCE_XLA_ENV",
           "base", "xla", "cpu",
           "cuda"]
