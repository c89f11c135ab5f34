"""The transports of the Echo all-reduce, behind one interface, and the plan of each call.

A transport is an object of a `base.Transport` subclass (the abstract interface: its methods
and capability attributes are documented there): `xla.TRANSPORT` (pure JAX, everywhere, the
reference), `cpu.TRANSPORT` (the XLA FFI custom call of `echo_jax._ffi`, host threads over
shared memory) and `cuda.TRANSPORT` (the CUDA custom calls of `echo_jax._ffi_cuda`, one GPU
per rank).

`plan` decides each call once, at trace time: the transport (`select`: "auto", "p2p", "xla"
and the kill switch), where the rotation runs (in the call, in JAX around it, none), how the
compensator runs (fused into the call, the apply step in the call and a separate update, in JAX
around an uncompensated call, none), where the rescaling's factor is applied, and why each
fallback happened. `echo_psum` makes the plan once per leaf and passes the frozen `CallPlan`,
static, to the functions that trace the call; nothing re-selects. `availability` is the one
answer to whether the custom call can run and why not, which `select`'s fallback warning
(`EchoFallbackWarning`), its "p2p" error and `python -m echo_jax doctor` all print.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from typing import NamedTuple

import jax
import numpy as np
from jax import lax

from echo_jax.config import EchoConfig
from echo_jax.transports import base, cpu, cuda, xla

#: Environment switch: set to 1 to force the pure-JAX transport everywhere (`echo_psum`).
FORCE_XLA_ENV = "ECHO_JAX_FORCE_XLA"


#: The transports, by module: what `select` and `plan` choose from.
XLA, CPU, CUDA = xla.TRANSPORT, cpu.TRANSPORT, cuda.TRANSPORT


def custom_call(platform=None) -> base.Transport:
    """The custom-call transport of a platform: `CUDA` on NVIDIA GPUs, else `CPU`.

    Args:
      platform: "cpu", "gpu", "cuda", ... (default: the one a call traced here runs on).
    """
    platform = base.current_platform() if platform is None else base.platform_name(platform)
    return CUDA if platform == "cuda" else CPU


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
        return Availability(chosen.name, None, None, platform)
    return Availability(XLA.name, found[1], found[0], platform)


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
           transport=None, where=None, honor_env=True) -> base.Transport:
    """The transport a call runs here: the one decision of "auto", "p2p" and the kill switch.

    "xla" runs "xla". "p2p" and "auto" run this platform's custom call where `availability`
    finds no reason against it (with the axis and the size known, its size limits too);
    elsewhere "auto" runs "xla" (the same bits), with an `EchoFallbackWarning` once per process
    and reason where that reason is one to fix (`Availability.warns`), and "p2p" raises with
    the same reason. `plan` calls it once per call site; so do the explicit entry points.

    Args:
      config: the call's EchoConfig.
      axis_name: the axis to reduce over, if known.
      num_elements: elements of one rank's flat contribution, if known (with the axis, the size
        limits are checked too).
      num_ranks: the axis size, if known (default: `lax.axis_size(axis_name)`).
      transport: "auto", "p2p" or "xla" instead of `config.transport`.
      where: a prefix for the error message (the public function called).
      honor_env: whether ECHO_JAX_FORCE_XLA=1 forces "xla" (`echo_psum` honours it; the
        explicit entry points of the custom calls do not).

    Returns:
      The `base.Transport` (`XLA`, `CPU` or `CUDA`).

    Raises:
      ValueError: the transport is "p2p" but the custom call cannot run here (says why).
    """
    return _decide(config, axis_name, num_elements, num_ranks=num_ranks, transport=transport,
                   where=where, honor_env=honor_env)[0]


def _decide(config, axis_name, num_elements, *, num_ranks=None, transport=None, where=None,
            honor_env=True) -> tuple[base.Transport, str | None]:
    """`select`'s transport and why it is not the custom call (None where it is, or where
    "xla" was asked for by name)."""
    requested = config.transport if transport is None else transport
    if honor_env and os.environ.get(FORCE_XLA_ENV, "") not in ("", "0"):
        return XLA, f"{FORCE_XLA_ENV} is set (the kill switch to pure JAX)"
    if requested == "xla":
        return XLA, None
    found = availability(axis=axis_name, config=config, num_elements=num_elements,
                         num_ranks=num_ranks)
    if found.reason is None:
        return custom_call(found.platform), None
    if requested == "p2p":
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}EchoConfig.transport='p2p' cannot run here: {found.reason}. "
                         "Use transport='auto' (falls back to 'xla') or transport='xla'.")
    warn_fallback(found)
    return XLA, found.reason


def resolve(config: EchoConfig, axis_name=None, num_elements=None, **kwargs) -> str:
    """The name ("xla" or "p2p") of the transport `select` chooses (same arguments)."""
    return select(config, axis_name, num_elements, **kwargs).name


def has_fused_compensation(transport: base.Transport) -> bool:
    """Whether a transport fuses the compensated all-reduce (`allreduce_compensated`)."""
    return bool(transport.fused_state_dtypes)


def has_fused_apply(transport: base.Transport) -> bool:
    """Whether a transport fuses the apply step alone into its call (`allreduce_applied`, for
    `EchoConfig.state_update="separate"`); it takes the state dtypes of its compensated call."""
    return has_fused_compensation(transport) and transport.fused_apply


def fused_state_dtypes(transport: base.Transport) -> tuple[str, ...]:
    """The compensator state dtypes (`EchoConfig.state_dtype`) a transport's fused compensated
    call takes; () where it has none."""
    return tuple(transport.fused_state_dtypes)


def has_fused_rotation(transport: base.Transport, config: EchoConfig) -> bool:
    """Whether a transport's calls rotate by themselves for this config (`plan` hands the
    rotation to the call only where this holds).

    Args:
      transport: a `base.Transport` (`select`'s result).
      config: the call's EchoConfig.
    """
    return bool(transport.fused_rotation(config))


# --------------------------------------------------------------------------------------------
# The plan of one call


#: Where a call's Hadamard rotation runs: none; inside the transport's call; in JAX around it.
ROTATIONS = ("none", "call", "jax")
#: How a call compensates (Algorithm 1 of the Echo paper): not at all; apply and update fused
#: into the call ("fused"); the apply step in the call's entry pass and the update as its own op
#: after it ("applied", `state_update="separate"`); apply, uncompensated call and update in JAX
#: ("jax").
COMPENSATIONS = ("none", "fused", "applied", "jax")


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """How one `echo_psum` call runs, decided once at trace time (`plan`).

    Frozen and hashable: the functions that trace the call take it as a static argument.
    """

    #: The transport that runs the protocol (`select`'s choice).
    transport: base.Transport
    #: The config the transport's call gets: the caller's, with rotation="none" where the
    #: rotation runs in JAX around the call.
    config: EchoConfig
    #: Where the rotation runs (ROTATIONS).
    rotation: str = "none"
    #: How the compensator runs (COMPENSATIONS).
    compensation: str = "none"
    #: The update step, where compensated: "in_call" (with the sum, inside the call or right
    #: after it in JAX) or "separate" (`compensator.update_beside`, after the call on its own).
    update: str = "none"
    #: Where update "separate" runs: "kernel" (the transport's one-pass `update_separate`) or
    #: "jax" (`compensator.update_beside`); "none" otherwise.
    separate_update: str = "none"
    #: echo_psum's rescale as `collective.check_rescale` resolves it (False, or True: the Echo
    #: paper Sec. 5.4 factor, taken from x in JAX; it is an operand of the transport's call, or
    #: applied in JAX around it with a JAX rotation).
    rescale: bool | str = False
    #: Why the plan is not the fastest one for this config, in the order decided: the custom
    #: call not running (the fallback's reason), the rotation or the compensation not fused.
    reasons: tuple[str, ...] = ()

    @property
    def direct(self) -> bool:
        """Whether x enters the transport's call in its own dtype and the sum leaves it so
        (a custom call, nothing in fp32 around it): compensation "none", "fused" or "applied"
        on a custom call without a JAX rotation."""
        return (self.transport.custom_call and self.rotation != "jax"
                and self.compensation != "jax")

    @property
    def factor_in(self) -> str:
        """Where the rescaling's factor multiplies x: "none" (rescale=False), "call" (an
        operand of the transport's call) or "jax" (around the call, with the JAX rotation)."""
        if self.rescale is False:
            return "none"
        return "jax" if self.rotation == "jax" else "call"

    def describe(self) -> str:
        """One line: transport, rotation, compensation and update, factor, reasons."""
        name = "p2p (custom call)" if self.transport.custom_call else self.transport.name
        parts = [f"transport {name}", f"rotation {self.rotation}",
                 f"compensation {self.compensation}"]
        if self.compensation != "none":
            parts.append(f"update {self.update}" + (
                f" ({self.separate_update})" if self.update == "separate" else ""))
        parts.append(f"rescale factor {self.factor_in}")
        text = ", ".join(parts)
        if self.reasons:
            text += " (" + "; ".join(self.reasons) + ")"
        return text


def plan(config: EchoConfig, axis_name=None, num_elements=None, *, num_ranks=None,
         state_dtype=None, rescale="auto", transport=None, where=None,
         honor_env=True) -> CallPlan:
    """The plan of one call: the one place that decides transport, rotation, compensation,
    update and factor, each with the reason where it is not the fused choice.

    The rules: the transport is `select`'s. The rotation (config.rotation="hadamard") runs in
    the call where the transport rotates by itself (`has_fused_rotation`), else in JAX around
    it, with the config's rotation set to "none" for the call. A compensated call (a state
    dtype given) is fused where the transport has a fused call for that state dtype and the
    rotation is not in JAX (a JAX rotation would hand the call rotated values while the state
    lives in the original basis); with `state_update="separate"` the apply step is fused
    ("applied") where the transport has that call. Otherwise the compensator runs in JAX around
    the uncompensated call. The rescaling's factor never unfuses anything (it is an operand of
    the fused calls). Every choice gives the same bits.

    Args:
      config: the call's EchoConfig.
      axis_name: the axis to reduce over, if known.
      num_elements: elements of one rank's flat contribution, if known.
      num_ranks: the axis size, if known.
      state_dtype: None for an uncompensated call, else the compensator state's dtype name.
      rescale: echo_psum's rescale as `collective.check_rescale` resolves it (False: no
        factor; True: the Sec. 5.4 factor).
      transport, where, honor_env: as `select`.

    Returns:
      A frozen `CallPlan`.

    Raises:
      ValueError: as `select` (transport "p2p" where the custom call cannot run).
    """
    chosen, fallback = _decide(config, axis_name, num_elements, num_ranks=num_ranks,
                               transport=transport, where=where, honor_env=honor_env)
    return plan_with(chosen, config, state_dtype=state_dtype, rescale=rescale,
                     fallback=fallback)


def resolve_rescale(rescale, where="echo_psum"):
    """echo_psum's rescale as True or False ("auto" is False: the wire format's bf16 group
    scales span fp32's range, so no contribution needs rescaling to fit it), or a ValueError
    that names the value."""
    if rescale is True or rescale is False:
        return rescale
    if isinstance(rescale, str) and rescale == "auto":
        return False
    if isinstance(rescale, np.bool_):
        return bool(rescale)
    raise ValueError(f"{where}: rescale must be True, False or 'auto', got {rescale!r}")


def plan_with(transport: base.Transport, config: EchoConfig, *, state_dtype=None,
              rescale="auto", fallback: str | None = None) -> CallPlan:
    """The plan of a call on a transport already chosen (`plan` after `select`; `python -m
    echo_jax doctor` with the transport `availability` gives an axis).

    Args:
      transport: the `base.Transport` the call runs.
      config, state_dtype, rescale: as `plan`.
      fallback: why the transport is not the custom call, if it is not.

    Returns:
      A frozen `CallPlan`.
    """
    rotation, compensation, reasons = call_modes(transport, config, state_dtype)
    if compensation == "jax" and config.residual == "local" and transport.custom_call:
        # The local residual exists only inside a protocol: the fused call's, or the "xla"
        # transport's in JAX. An uncompensated custom call returns y alone.
        why = "; ".join(r for r in reasons if r.startswith("compensation")) or "not fused"
        raise ValueError(
            f"EchoConfig.residual='local' needs the fused compensated call, and this call's "
            f"compensation does not fuse ({why}); use residual='output', or transport='xla'")
    if fallback is not None:
        reasons = (f"not the custom call: {fallback}",) + reasons
    call_config = config.replace(rotation="none") if rotation == "jax" else config
    update = "none" if state_dtype is None else config.state_update
    separate = "none"
    if update == "separate":
        separate = "kernel" if (transport.separate_update and state_dtype
                                in fused_state_dtypes(transport)
                                and state_dtype in base.WIDE_STATE_DTYPES) else "jax"
    rescale = resolve_rescale(rescale, "transports.plan")
    return CallPlan(transport, call_config, rotation, compensation, update, separate, rescale,
                    reasons)


def call_modes(transport: base.Transport, config: EchoConfig,
               state_dtype=None) -> tuple[str, str, tuple[str, ...]]:
    """`plan`'s rules for a chosen transport: where the rotation runs, how the compensator
    runs, and why each is not fused where the transport is a custom call.

    Args:
      transport: the `base.Transport` the call runs.
      config: the call's EchoConfig.
      state_dtype: None (uncompensated) or the state's dtype name.

    Returns:
      (rotation in ROTATIONS, compensation in COMPENSATIONS, reasons).
    """
    reasons = []
    rotation = "none"
    if config.rotation == "hadamard":
        rotation = "call" if has_fused_rotation(transport, config) else "jax"
        if rotation == "jax" and transport.custom_call:
            reasons.append(f"rotation in JAX: the custom call does not rotate groups of "
                           f"{config.group_size}")
    compensation = "none"
    if state_dtype is not None:
        compensation = "applied" if config.state_update == "separate" else "fused"
        why = None
        if not has_fused_compensation(transport):
            why = ""  # the "xla" transport: nothing is fused, nothing to explain
        elif rotation == "jax":
            why = "the rotation runs in JAX around the call (the state stays unrotated)"
        elif state_dtype not in fused_state_dtypes(transport):
            why = f"the call takes no {state_dtype} state"
        elif compensation == "applied" and not has_fused_apply(transport):
            why = "the call has no apply-only variant"
        elif compensation == "applied" and state_dtype not in base.WIDE_STATE_DTYPES:
            why = f"the applied call takes no {state_dtype} state"
        elif state_dtype in base.QUANTIZED_STATE_DTYPES and config.group_size != base.STATE_GROUP:
            why = (f"the call's {state_dtype} state needs group_size {base.STATE_GROUP} (a wire group is "
                   f"a state group), got {config.group_size}")
        else:
            why = transport.fused_state_reason(config, state_dtype)
        if why is not None:
            compensation = "jax"
            if why:
                reasons.append(f"compensation in JAX: {why}")
    return rotation, compensation, tuple(reasons)


__all__ = ["plan", "plan_with", "CallPlan", "call_modes", "ROTATIONS", "COMPENSATIONS", "XLA", "CPU", "CUDA",
           "select", "resolve", "custom_call", "availability", "Availability",
           "EchoFallbackWarning", "warn_fallback", "fallback_message", "reset_fallback_warnings",
           "REASON_KINDS", "WARNING_KINDS", "unavailable_reason", "limit_reason",
           "has_fused_compensation", "has_fused_apply", "fused_state_dtypes",
           "has_fused_rotation", "FORCE_XLA_ENV",
           "base", "xla", "cpu",
           "cuda"]
