"""The transports of the Echo all-reduce, behind one small interface, and the one choice of them.

A transport is a module with

* ``NAME``: the value of `EchoConfig.transport` that names it ("xla", or "p2p" for both custom
  calls);
* ``unavailable_reason(axis_name=None)``: None where it can run in this tracing context, else a
  sentence that says why not; a custom call also has ``unavailable(axis_name=None,
  platform=None, devices=None)``, the same answer as (kind, sentence) for `availability`
  (kinds: REASON_KINDS), asked of a trace or of the devices of one mesh axis;
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
`echo_jax._ffi_cuda`, one GPU per rank). `select` is the one place that decides which runs;
`availability` is the one answer to whether the custom call can run and why not, which
`select`'s fallback warning (`EchoFallbackWarning`), its "p2p" error and
`python -m echo_jax doctor` all print.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import NamedTuple

import jax
from jax import lax

from echo_jax.config import EchoConfig
from echo_jax.transports import base, cpu, cuda, xla

#: Environment switch: set to 1 to force the pure-JAX transport everywhere (`echo_psum`).
FORCE_XLA_ENV = "ECHO_JAX_FORCE_XLA"


def custom_call(platform=None):
    """The custom-call transport of a platform: `cuda` on NVIDIA GPUs, else `cpu`.

    Args:
      platform: "cpu", "gpu", "cuda", ... (default: the one a call traced here runs on).
    """
    platform = base.current_platform() if platform is None else base.platform_name(platform)
    return cuda if platform == "cuda" else cpu


class EchoFallbackWarning(UserWarning):
    """transport="auto" runs the pure-JAX "xla" transport where the Echo custom call was meant
    to run (its module missing or refused by this jaxlib, or the mesh unfit for it): the same
    bits, more time. Shown once per process, platform and reason; the message names the fix."""


#: The kinds of reason `availability` reports, and what they mean.
REASON_KINDS = {
    "not_built": "the custom call's module is not built (or does not load)",
    "build_mismatch": "the module was built against XLA FFI headers this jaxlib refuses",
    "processes": "the run has several processes; the custom call's ranks share one process",
    "ranks": "the reduced axis has more ranks than the custom call takes",
    "mesh": "the devices of the group are not GPUs of this process in the concrete mesh",
    "peer_access": "two GPUs of the group have no peer access to each other",
    "limits": "the call's size is beyond the custom call's limits (group or segment length)",
    "context": "the trace rules a custom call out (outside shard_map, a vmap axis, auto axes)",
    "platform": "no custom call exists for this platform",
}

#: The kinds for which "auto" warns (`EchoFallbackWarning`), per platform: on GPUs every reason
#: that costs the custom call where a user meant to run it; on CPU only a module that is
#: missing or refused. The trace's own reasons ("context": vmap, outside shard_map) never warn.
WARNING_KINDS = {
    "cuda": frozenset({"not_built", "build_mismatch", "processes", "ranks", "mesh",
                       "peer_access", "limits"}),
    "cpu": frozenset({"not_built", "build_mismatch"}),
}

_warned: set = set()
_warned_lock = threading.Lock()


class Availability(NamedTuple):
    """What "auto" runs, and why not the custom call (`availability`'s answer)."""

    #: The transport "auto" runs: "p2p" (the custom call) or "xla".
    name: str
    #: Why the custom call cannot run, with the fix (None where it runs); the same sentence
    #: the "p2p" error, the fallback warning and `python -m echo_jax doctor` print.
    reason: str | None = None
    #: The reason's key in REASON_KINDS (None where the custom call runs).
    kind: str | None = None
    #: The platform asked about ("cpu", "cuda", ...).
    platform: str = "cpu"

    @property
    def warns(self) -> bool:
        """Whether "auto" warns about this fallback (WARNING_KINDS)."""
        return self.kind in WARNING_KINDS.get(self.platform, ())


def availability(platform=None, axis=None, *, devices=None, config: EchoConfig | None = None,
                 num_elements=None, num_ranks=None) -> Availability:
    """Whether the custom call of a platform can run, and why not: the one check behind
    `select` (so `echo_psum`, `resolve_transport`, the "p2p" error and the fallback warning)
    and `python -m echo_jax doctor`.

    Asked inside a trace (`devices` None), it checks the trace (`jax.shard_map` manual over
    `axis`), the process, the module and, with `axis`, the group of the concrete mesh. Asked
    with `devices` (no trace needed), it checks the process, the module and those devices as
    the group of one mesh axis, for a call traced inside a `jax.shard_map` manual over it
    under `jax.set_mesh`.

    Args:
      platform: "cpu", "gpu", "cuda", ... (default: the one a call traced here runs on).
      axis: the axis to reduce over inside the trace here, if known.
      devices: instead of the trace, the devices of one mesh axis.
      config: with `num_elements`, the size limits are checked too ("limits").
      num_elements: elements of one rank's flat contribution, if known.
      num_ranks: the axis size, if known (default: `lax.axis_size(axis)`, or len(devices)).

    Returns:
      Availability(name "p2p" or "xla", reason, kind (REASON_KINDS), platform).
    """
    platform = base.current_platform() if platform is None else base.platform_name(platform)
    chosen = custom_call(platform)
    found = chosen.unavailable(axis, platform=platform, devices=devices)
    if (found is None and config is not None and num_elements is not None
            and (axis is not None or devices is not None)):
        if num_ranks is None:
            num_ranks = len(devices) if devices is not None else lax.axis_size(axis)
        limit = chosen.limit_reason(config, int(num_elements), int(num_ranks))
        found = None if limit is None else ("limits", limit)
    if found is None:
        return Availability(chosen.NAME, None, None, platform)
    return Availability(xla.NAME, found[1], found[0], platform)


def fallback_message(found: Availability) -> str:
    """The text of the fallback warning for an `availability` answer that runs "xla"."""
    cost = ("the same bits in more time: on NVLink GPUs slower than the lax.psum it replaces"
            if found.platform == "cuda" else "the same bits in more time")
    return (f"echo_jax: transport='auto' runs the pure-JAX 'xla' transport on {found.platform}, "
            f"not the Echo custom call ({cost}), "
            f"because {found.reason}. Shown once per process for this reason "
            f"({found.kind}); `python -m echo_jax doctor` shows what is installed and which "
            "transport each axis gets; transport='xla' states the choice and silences it.")


def warn_fallback(found: Availability) -> bool:
    """Warns (`EchoFallbackWarning`) that "auto" falls back for `found`, once per process,
    platform and kind of reason, where `found.warns`; returns whether it warned now."""
    if not found.warns:
        return False
    key = (found.platform, found.kind)
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
    # Attributed to the first frame outside echo_jax and jax: the user's call.
    skip = (os.path.dirname(os.path.dirname(os.path.abspath(base.__file__))) + os.sep,
            os.path.dirname(os.path.abspath(jax.__file__)) + os.sep)
    warnings.warn(fallback_message(found), EchoFallbackWarning, skip_file_prefixes=skip)
    return True


def reset_fallback_warnings() -> None:
    """Forgets which fallback warnings were shown (tests), so each shows once more."""
    with _warned_lock:
        _warned.clear()


def unavailable_reason(axis_name=None) -> str | None:
    """Why the "p2p" custom call of this platform cannot run here (None when it can):
    `availability`'s reason.

    Args:
      axis_name: the axis to reduce over, if known; without it only the context is checked.
    """
    return availability(axis=axis_name).reason


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

    "xla" runs "xla". "p2p" and "auto" run this platform's custom call where `availability`
    finds no reason against it (with the axis and the size known, its size limits too);
    elsewhere "auto" runs "xla" (the same bits), with an `EchoFallbackWarning` once per process
    and reason where that reason is one to fix (`Availability.warns`), and "p2p" raises with
    the same reason.

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
    found = availability(axis=axis_name, config=config, num_elements=num_elements,
                         num_ranks=num_ranks)
    if found.reason is None:
        return custom_call(found.platform)
    if requested == "p2p":
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}EchoConfig.transport='p2p' cannot run here: {found.reason}. "
                         "Use transport='auto' (falls back to 'xla') or transport='xla'.")
    warn_fallback(found)
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


__all__ = ["select", "resolve", "custom_call", "availability", "Availability",
           "EchoFallbackWarning", "warn_fallback", "fallback_message", "reset_fallback_warnings",
           "REASON_KINDS", "WARNING_KINDS", "unavailable_reason", "limit_reason",
           "has_fused_compensation", "has_fused_apply", "fused_state_dtypes",
           "has_fused_rotation", "FORCE_XLA_ENV",
           "base", "xla", "cpu",
           "cuda"]
