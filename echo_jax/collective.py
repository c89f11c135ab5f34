"""`echo_psum`: the Echo quantized all-reduce, a drop-in for `lax.psum` (the Echo paper Sec. 4).

Protocol (the same for every transport, so they produce the same bits):

1. Flatten x to fp32 (after the compensator's apply step, Eq. 10) and pad it with zeros to
   P segments of Gs whole groups each; segment j is owned by rank j. A bfloat16 / float16 x is
   widened exactly, and the fp32 sum is rounded back to x's dtype (to nearest even) at the end.
   Where the "p2p" custom call runs and nothing else has to happen in fp32 around it
   (uncompensated, or compensated in the fused call; rescaled or not, the factor being an operand
   of the call; no rotation, or the rotation fused into the call), the 16-bit x goes
   into the call as it is and the sum comes out in x's dtype: the call widens and rounds itself,
   with the same bits, and no fp32 copy of x is made in XLA. The compensator state is updated
   with the fp32 sum, before its rounding; it is stored in `EchoConfig.state_dtype` (fp32 by
   default; a bfloat16 state is widened exactly for the arithmetic and the new averages are
   rounded to nearest even, `echo_jax.compensator`).
2. Push: every rank quantizes every segment and sends segment j to its owner j (all-to-all).
3. Reduce: owner j dequantizes the P-1 copies it received and adds them to its own full-precision
   segment in fp32, in rank order 0..P-1 with its own value at its own position, then quantizes
   the sum once.
4. Gather: the owner's code goes to every rank (all-gather); every rank, the owner included,
   dequantizes the same codes, so all ranks return identical bits. Every element is quantized at
   most twice for any P.

Rotation (`EchoConfig.rotation="hadamard"`): the compensated fp32 input is padded with zeros to
whole groups and every group is rotated by a fixed randomized Hadamard matrix (`echo_jax.rotation`)
before step 1, and the sum is rotated back and cut to x's length after step 4, so one outlier
channel no longer sets its group's scale. The compensator's apply and update steps stay in the
original basis; the rescaling's factor (from x, aiming sqrt(g) lower) multiplies x before the
rotation and divides the sum after the inverse rotation. Inside the call where the chosen
transport rotates by itself (the CPU and CUDA custom calls); x then enters the call as on the
unrotated direct and fused paths, and a compensated call stays fused (apply, scale, rotate,
protocol, unrotate, unscale, update, all in the call). Otherwise (the "xla" transport, or a
custom call that does not rotate groups of this size) it is plain JAX around the transport,
which then gets the config with rotation="none" (`_rotated_allreduce_f32`,
`transports.xla.rotated_allreduce`), and the compensator's steps run in JAX around it. Both give
the same bits ("xla" == "p2p"). Gradients are psum's on every path (straight-through).

The call plan (`echo_jax.transports.plan`): each leaf's call is decided once, at trace time —
the transport ("xla", or the "p2p" custom call of the platform, CPU or CUDA), where the rotation
runs, whether the compensator is fused into the call (its apply and update steps, for the state
dtypes the call takes: fp32 and bfloat16 on the CPU and CUDA calls; not with a rotation in JAX,
since the state lives in the original basis) or runs in JAX around the uncompensated call, and
the reason for every fallback. The frozen `CallPlan` goes, static, to the functions that trace
the call; nothing re-selects. "xla" and "p2p" give the same bits on every path.

Where the update runs (`EchoConfig.state_update`): "in_call" as above; "separate" (the Echo
paper Sec. 5.3, Appendix C): the call runs the apply step only (fused into the custom call's
entry pass where the transport has `allreduce_applied`, else in JAX) and the update is its own op
after it, `compensator.update_beside`, on a second GPU stream so that it can run beside the next
matrix multiplication. Its residual takes y as returned (in x's dtype): the same bits as
"in_call" for float32 x, on every transport.

psum's contract (docs/design.md, "The psum contract"): `echo_psum` takes what `lax.psum` takes
inside shard_map, vmap and pmap and returns psum's result type. Float leaves run the protocol
above; bool and integer leaves are summed exactly by `lax.psum` (never quantized, no state); a
tuple of axis names is one group, their product, ranks in `lax.axis_index(axes)` order (the
"xla" transport: `lax.all_to_all` and the all-gather take the tuple; the custom calls find their
rank and peers on one mesh axis, so "auto" picks "xla" for a tuple and "p2p" raises); a value not
batched along a vmap axis is every rank's contribution; a Python float keeps its weak type.
Refused with a message that names the fix: complex leaves, `axis_index_groups`, values typed
unreduced or reduced (explicit sharding).

Size gate: a contribution of fewer than `EchoConfig.min_bytes` bytes per rank (each array of a
pytree decided on its own, statically from its shape and dtype) is summed by `lax.psum` instead,
exactly and with psum's own semantics; its compensator state is returned unchanged.

The "xla" transport runs this with `lax.all_to_all` and an all-gather, so it works on CPU, GPU and
TPU, across hosts and under `jax.vmap(..., axis_name=...)` (P simulated ranks on one device). It is
also the reference of the "p2p" custom call.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from echo_jax import _compat
from echo_jax import compensator as comp
from echo_jax import partial_manual, transports
from echo_jax.config import EchoConfig
# Re-exported: their homes are the transports (the wire layout, the kill switch, the reference).
from echo_jax.transports import FORCE_XLA_ENV
from echo_jax.transports.base import segment_layout
from echo_jax.transports.xla import (rotated_allreduce, xla_allreduce, xla_allreduce_local,
                                     xla_allreduce_scaled)

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class UnboundAxisError(NameError, ValueError):
    """An axis name that is not bound where the call runs: a NameError, as `lax.psum` raises
    for it, and a ValueError, as echo_jax raised before (so both kinds of handler catch it).
    The message names the axis and the fix."""


def axis_size(axis_name, where: str = "echo_psum") -> int:
    """Size of a bound mesh/vmap axis (the product of the sizes for a tuple of axis names), or an
    `UnboundAxisError` (a NameError, as psum's, and a ValueError) that names the axis."""
    if isinstance(axis_name, (tuple, list)) and len(axis_name) != 1:
        size = 1
        for name in _axes(axis_name, where):
            size *= axis_size(name, where)
        return size
    name = single_axis(axis_name, where)
    try:
        return lax.axis_size(name)
    except NameError:
        raise UnboundAxisError(
            f"{where}: unbound axis name: {name} (the axis name {name!r} is not bound here). Call "
            f"it inside jax.shard_map over a mesh with an axis {name!r}, or inside "
            f"jax.vmap(..., axis_name={name!r}).") from None


def _axes(axis_name, where="echo_psum") -> tuple:
    """`axis_name` as a tuple of axis names (one name, or a tuple / list of them, as `lax.psum`
    takes it), each checked; a ValueError that names the problem otherwise."""
    names = _compat.axis_names(axis_name)
    for name in names:
        if isinstance(name, (tuple, list)):
            raise ValueError(f"{where}: axis_name must be an axis name or a flat tuple of them, "
                             f"got {axis_name!r}")
        single_axis(name, where)
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: axis_name {axis_name!r} names an axis twice")
    return names


def _axis_arg(names: tuple):
    """The axis argument the protocol runs with: the name itself for one axis (the custom
    calls' form), the tuple for several (one group: their product, `lax.axis_index(names)`
    order)."""
    return names[0] if len(names) == 1 else names


def _multi_axis_reason(axis) -> str | None:
    """Why the custom calls cannot reduce over `axis` (None for one axis name): they find their
    rank and peers on one mesh axis (`transports.cpu._coords`, the CUDA call's device ids)."""
    if not isinstance(axis, tuple) or len(axis) < 2:
        return None
    return (f"the custom call reduces over one mesh axis, and axis_name={axis!r} names "
            f"{len(axis)}. Use transport='auto' or 'xla' (the same bits: the pure-JAX "
            "transport's all_to_all and all-gather run over the product group), or give the "
            "mesh one axis for this group (e.g. reshape the devices so that the axes "
            f"{axis!r} become one axis) and reduce over it")


def _config_for_axes(config: EchoConfig, axis, where="echo_psum") -> EchoConfig:
    """The config a call over `axis` runs with: for several axis names, transport "xla" (a
    "p2p" request raises a ValueError that names the axes and the fix); config otherwise."""
    reason = _multi_axis_reason(axis)
    if reason is None or config.transport == "xla":
        return config
    if config.transport == "p2p":
        raise ValueError(f"{where}: EchoConfig.transport='p2p' cannot run here: {reason}.")
    return config.replace(transport="xla")


def single_axis(axis_name, where: str = "echo_psum"):
    """One mesh or vmap axis name, checked: a one-element tuple / list is unwrapped; several
    names, an integer or an unhashable value raise a ValueError that names `where` and the fix.

    Args:
      axis_name: what the caller passed as the axis.
      where: the public function, for the message.

    Returns:
      The axis name.
    """
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 1:
            raise ValueError(f"{where}: reduces over exactly one axis name, got {axis_name!r}; "
                             "reduce over a flattened axis or call it once per axis")
        axis_name = axis_name[0]
    if isinstance(axis_name, (int, np.integer)) or getattr(axis_name, "__hash__", None) is None:
        # lax.psum reads an integer as a positional axis of the array; echo_psum reduces over a
        # named mesh or vmap axis only, so an integer is a mistake here, not an axis.
        raise ValueError(f"{where}: axis_name must be the name of a mesh or vmap axis (e.g. "
                         f"'tp'), got {axis_name!r}")
    return axis_name


def _sealed(fn, *args, **kwargs):
    """fn(*args, **kwargs) traced as one `jax.jit` call whose operands are the arrays among the
    arguments (everything else is static): the constants of the protocol (the quantizer's
    reciprocal table, the rotation's signs) stay inside that call, so that a jaxpr of
    echo_psum has no constvars, as psum's has none (`jax.make_jaxpr(f)(x).jaxpr` evaluates
    with no constants). XLA inlines the call; the bits are the same."""
    flat, tree = jax.tree.flatten((args, kwargs))
    where = [i for i, a in enumerate(flat) if isinstance(a, (jax.Array, np.ndarray))]

    def call(*operands):
        leaves = list(flat)
        for i, a in zip(where, operands):
            leaves[i] = a
        a, k = jax.tree.unflatten(tree, leaves)
        return fn(*a, **k)

    return jax.jit(call)(*[flat[i] for i in where])


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _allreduce_f32(x_flat32, factor, axis, num_ranks, plan):
    # x: flat fp32, or bfloat16 / float16 for the custom call (fp32 arithmetic inside either
    # way); the sum comes back in x's dtype. factor: None, or the f32 power of two of the
    # rescaling (applied inside the custom call, around xla_allreduce on the xla transport).
    # plan: the call's `transports.CallPlan` (its config rotates only where the call does).
    return _sealed(plan.transport.allreduce, x_flat32, axis, num_ranks, plan.config,
                   factor=factor)


@_allreduce_f32.defjvp
def _allreduce_f32_jvp(axis, num_ranks, plan, primals, tangents):
    # Straight-through: the derivative of the quantized sum is taken as that of the exact sum.
    # A 16-bit tangent is summed in fp32 and rounded once, as on the fp32 path around the call
    # (x.astype(f32) -> sum -> astype), so both paths give the same derivative bits. The factor
    # is a constant of the derivative (a power of two chosen from stopped values).
    (x, factor), (t, _) = primals, tangents
    t = t.astype(jnp.float32)
    return _allreduce_f32(x, factor, axis, num_ranks, plan), lax.psum(t, axis).astype(x.dtype)


def resolve_transport(config: EchoConfig, axis=None, num_elements=None) -> str:
    """The transport a call with this config runs here ("xla" or "p2p"): `transports.select`.

    Args:
      config: the call's EchoConfig.
      axis: the axis to reduce over, if known: one name, or a tuple of names (the custom calls
        reduce over one mesh axis, so a tuple of several gives "xla" under "auto").
      num_elements: elements of one rank's flat contribution, if known: "auto" then also checks
        the custom call's size limits (group size, ranks, segment length) and falls back to
        "xla" beyond them.

    Raises:
      ValueError: config.transport == "p2p" but the custom call cannot run here (says why; for
        a tuple of axis names, names them and the fix).
    """
    if axis is not None:
        names = _axes(axis, "resolve_transport")
        axis = _axis_arg(names) if names else None
        config = _config_for_axes(config, axis, "resolve_transport")
    return transports.resolve(config, axis, num_elements)


#: The values of echo_psum's `rescale`.
RESCALE_MODES = (False, True, "auto")

#: log2 of the bound rescale=True keeps P * max |x * factor| below (times sqrt(g) with the
#: rotation): 2^15. For P <= 64 the target [256, 512) is below it; for larger groups the factor
#: is lowered so that the sum of P scaled contributions stays below 2^15 too.
RESCALE_TOP_LOG2 = 15


def _ceil_log2(n: int) -> int:
    return max(int(n) - 1, 0).bit_length()


def rescale_ceiling(num_ranks: int, headroom_log2: int = 0) -> float:
    """The bound T that rescale=True keeps the scaled max |x| below:
    2^(RESCALE_TOP_LOG2 - ceil(log2 P) - headroom_log2), e.g. 8192 at P = 4 and 4096 at P = 8
    without the rotation (only binding for P > 64, where [256, 512) would pass it).

    Args:
      num_ranks: P, the size of the reduced group.
      headroom_log2: `rotation_headroom_log2(config)` (0 without the rotation).
    """
    return 2.0 ** (RESCALE_TOP_LOG2 - _ceil_log2(num_ranks) - int(headroom_log2))


def check_rescale(rescale, where="echo_psum"):
    """rescale as True or False ("auto" is False), or a ValueError that names the value
    (`transports.resolve_rescale`, which `transports.plan` applies too)."""
    return transports.resolve_rescale(rescale, where)


def rotation_headroom_log2(config: EchoConfig) -> int:
    """k such that the rescaling of a rotated call aims 2^k lower: ceil(log2(g) / 2) with
    rotation="hadamard" (a rotated value is at most sqrt(g) max |x|), else 0."""
    if config.rotation != "hadamard":
        return 0
    return (int(config.group_size).bit_length() - 1 + 1) // 2


def rescale_factor(x, axis, mode=True, headroom_log2: int = 0, num_ranks: int | None = None):
    """Shared power-of-two factor of the rescaling (the Echo paper Sec. 5.4), f32 scalar.

    One scalar `pmax` of the largest finite |x| across the group (NaN and +-inf are left out:
    their groups are NaN whatever the factor, and the other groups still get theirs). With
    T = `rescale_ceiling(P, headroom_log2)` (2^15 / P, rounded down to a power of two, and
    2^headroom_log2 lower with the rotation): the max lands in [256, 512) / 2^headroom_log2, or
    in [T / 2, T) where that is lower (P > 64). 1 when the max is 0. Multiplying and dividing by
    it is exact (a normal power of two, 2^-126 .. 2^120).

    Args:
      x: this rank's values (any float dtype; the max is taken in it, no fp32 copy of x).
      axis: the bound axis of the all-reduce (or a tuple of axis names).
      mode: True (the only mode that scales; kept as an argument for echo_psum's `rescale`).
      headroom_log2: aim this many powers of two lower (`rotation_headroom_log2`: the rotation
        can raise a group's max by up to sqrt(g), so a rotated call keeps its rotated values
        in range too).
      num_ranks: P (default: the size of `axis`); the reduce stage sums P copies, so the bound
        is P times lower.
    """
    if mode is not True:
        raise ValueError(f"rescale_factor: mode must be True, got {mode!r} (rescale='auto' "
                         "and False take no factor)")
    # The factor is a constant of the derivative (a power of two chosen from the data): take it
    # from a stopped value, so that grad / jvp never differentiate the pmax (no rule for it).
    x = lax.stop_gradient(x)
    if x.size:
        mag = jnp.abs(x)
        local = jnp.max(jnp.where(jnp.isfinite(mag), mag, jnp.zeros((), mag.dtype)))
        local = local.astype(jnp.float32)
    else:
        local = jnp.float32(0)
    amax = lax.pmax(local, axis)
    num_ranks = lax.axis_size(axis) if num_ranks is None else int(num_ranks)
    top = RESCALE_TOP_LOG2 - _ceil_log2(num_ranks) - int(headroom_log2)
    _, e = jnp.frexp(amax)  # amax in [2^(e-1), 2^e)
    k = jnp.clip(min(9 - int(headroom_log2), top) - e, -126, 120)
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, jnp.ldexp(jnp.float32(1), k), jnp.float32(1))


def power_of_two_scale(x32, axis):
    """`rescale_factor(x32, axis, True)`: max |x| over the group lands in [256, 512)."""
    return rescale_factor(x32, axis, True)


def _check_sharding_type(x, axis, where="echo_psum"):
    """A ValueError that names the type and the fix where x is typed unreduced or reduced (the
    explicit-sharding types, `jax.typeof(x)` shows {U:...} / {R:...}): Echo's quantizer is not
    linear, so it cannot run on a pending sum, and a reduced value is not a per-rank
    contribution."""
    names = set(axis) if isinstance(axis, tuple) else {axis}
    unreduced, reduced = _compat.unreduced_axes(x), _compat.reduced_axes(x)
    if unreduced:
        mine = sorted(unreduced & names)
        what = (f"over the reduced axes {mine}" if mine else
                f"over mesh axes {sorted(unreduced)} (not reduced by this call)")
        fix = ("make the partial sum a varying value instead (inside jax.shard_map, leave it as "
               "the local computation produced it: no in_specs / out_sharding with "
               "unreduced=..., no lax.pcast(..., to='unreduced')), or reduce it exactly with "
               f"lax.psum(x, {axis!r})") if mine else (
               f"reduce it over {sorted(unreduced)} first (lax.psum, or jax.reshard to a "
               "sharding without unreduced=)")
        raise ValueError(
            f"{where}: x is typed unreduced {what} ({jax.typeof(x).str_short(True)}). Echo "
            "quantizes each rank's contribution, which must be typed varying over the axis "
            f"(JAX has no cast from unreduced to varying); {fix}.")
    if reduced:
        mine = sorted(reduced & names)
        fix = (f"lax.psum refuses it too: a reduced value is the same on every rank of "
               f"{mine}; sum it as a per-rank contribution after "
               f"lax.pcast(x, {tuple(mine)!r}, to='varying')") if mine else (
               f"cast it first with lax.pcast(x, {tuple(sorted(reduced))!r}, to='varying') (the "
               "sum is then typed varying over those axes)")
        raise ValueError(
            f"{where}: x is typed reduced over mesh axes {sorted(reduced)} "
            f"({jax.typeof(x).str_short(True)}), which echo_psum does not take; {fix}.")


def _batched_over(x, axis):
    """x as one value per rank along the axes of `axis` that are not manual shard_map axes
    (vmap, pmap): a value not batched along a vmap axis (in_axes=None, a closed-over constant, a
    Python scalar) is every rank's contribution, as in `lax.psum` (the sum is P * x), so it is
    broadcast along the axis here (a select of x with itself, which XLA removes)."""
    names = axis if isinstance(axis, tuple) else (axis,)
    manual = _compat.manual_axes()
    others = tuple(a for a in names if a not in manual)
    if not others:
        return x
    return _broadcast_along(x, others[0] if len(others) == 1 else others)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _broadcast_along(x, axis):
    index = lax.axis_index(axis)
    return jnp.where(index >= 0, x, x)


@_broadcast_along.defjvp
def _broadcast_along_jvp(axis, primals, tangents):
    # The broadcast is the identity on values, and so is its derivative: the tangent passes as
    # it is. Differentiated as the select it is written as, an unbatched cotangent would come
    # back batched along the axis (the select's predicate is), so that the gradient of an
    # echo_psum would be batched where psum's is not (psum's transpose keeps an unbatched
    # cotangent unbatched: `vmap(grad(f), out_axes=None, axis_name=...)`).
    (x,), (t,) = primals, tangents
    return _broadcast_along(x, axis), t


def _echo_leaf(x, state, axis, config: EchoConfig, rescale: bool):
    """One leaf of `echo_psum`: (its sum, its new state or None)."""
    if comp.leaf_kind(x) == "exact":
        # Exact: an integer sum has no rounding error to save, and counts, indices and the
        # axis-size idiom psum(1, axis) must stay exact; psum's own result type (bool -> int32).
        if state is not None:
            raise ValueError(f"echo_psum: a {jnp.result_type(x)} leaf is summed exactly and "
                             "takes no compensator state: put None at its place in the state "
                             "pytree (init_state(x) does)")
        return lax.psum(x, axis), None
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    x = jnp.asarray(x)
    _check_sharding_type(x, axis)
    if x.dtype in SUPPORTED_DTYPES:
        y, state = _echo_float(x, state, axis, config, rescale)
    else:
        # float64 (jax_enable_x64) and the 8-bit floats: Echo's arithmetic is fp32 anyway.
        if state is not None:
            comp.check_state(state, x, config=config)
        y, state = _echo_float(x.astype(jnp.float32), state, axis, config, rescale)
        y = y.astype(x.dtype)
    return (_compat.weakly_typed(y) if weak else y), state


def _echo_float(x, state, axis, config: EchoConfig, rescale: bool):
    dtype = jnp.result_type(x)
    if state is not None:
        comp.check_state(state, x, config=config)
    num_ranks = axis_size(axis)
    if num_ranks == 1:
        return x, state
    x = _compat.to_varying(x, axis)  # psum semantics: an invariant x counts once per rank
    x = _batched_over(x, axis)       # and so does an unbatched one under vmap
    if config.gated(int(jnp.size(x)) * dtype.itemsize):
        # Size gate: a small message is latency-bound, so the exact psum is the faster call.
        # Nothing was quantized, so there is no error to feed back: the state passes through.
        return lax.psum(x, axis), state
    flat = jnp.ravel(x)
    shape = jnp.shape(x)
    if state is not None:
        state = jax.tree.map(lax.stop_gradient, state)
        state = comp.to_varying_state(state, axis)
        m = comp.flat_state(state)
    plan = transports.plan(config, axis, flat.shape[0], num_ranks=num_ranks,
                           state_dtype=None if state is None else config.state_dtype,
                           rescale=rescale)
    # The rescaling factor (rescale=True) comes from x itself (before the apply step), on every
    # path, so that the fused call needs no fp32 copy of x' in XLA: x' differs from x by the
    # small correction, far inside the headroom the factor leaves (P * max |x| * factor < 2^15).
    # With the rotation it aims sqrt(g) lower (a rotated value is at most sqrt(g) max |x|) and
    # multiplies x before the rotation.
    factor = None if rescale is False else rescale_factor(
        flat, axis, rescale, rotation_headroom_log2(config), num_ranks)
    if plan.direct and plan.compensation == "none":
        # Nothing runs in fp32 around the custom call: x enters it in its own dtype (the call
        # widens a 16-bit x exactly, and multiplies by the factor) and the sum leaves it in x's
        # dtype, divided by the factor and rounded from fp32 as y32.astype(dtype) rounds it.
        return _allreduce_f32(flat, factor, axis, num_ranks, plan).reshape(shape), None
    if plan.compensation == "applied":
        # The apply step in the call's entry pass; the update after it as its own op.
        y = _applied_allreduce_f32(flat, state.m1, state.m2, factor, axis, num_ranks, plan)
        y = y.reshape(shape)
        return y, _update_after(x, y, num_ranks, state, plan)
    if plan.compensation == "fused":
        # Fused compensation (Sec. 5.3): the apply step runs in the call's entry pass and the
        # state update inside the call, with the fp32 sum (unrotated first where the call
        # rotates); m1/m2 are updated in place. They go in and come out in their own shape: a
        # reshape around an operand the call updates in place made XLA copy m1 and m2 before
        # and after every call in a loop (a scan over sites with an N-D contribution: four
        # state copies a site, more traffic than the fused update itself).
        y, m1, m2 = _fused_allreduce_f32(flat, state.m1, state.m2, factor, axis, num_ranks,
                                         plan)
        return y.reshape(shape), comp.CompensatorState(m1, m2)
    # In JAX around the call (the xla transport; or a custom call with a state dtype it does
    # not take or a rotation in JAX): apply, the uncompensated call (rescaled and, with a
    # rotation in the call, rotated inside), update.
    x32 = flat.astype(jnp.float32)
    k = comp.Coefficients.from_config(config)
    if state is not None:
        x32 = comp.apply_correction(x32, m, k)
    if state is not None and plan.config.residual == "local":
        # The "xla" transport's protocol with each rank's rounding errors (EchoConfig.residual;
        # plan_with allows no other transport here, and the config no rotation).
        y32, u = _local_allreduce_f32(x32, factor, axis, num_ranks, plan)
        new = jax.tree.map(lax.stop_gradient, comp.update_with_residual(u, m, k))
        return y32.reshape(shape).astype(dtype), comp.shaped_state(new, shape)
    if plan.rotation == "jax":
        # In JAX around the unrotated call: scale, rotate, reduce, rotate back, unscale.
        y32 = _rotated_allreduce_f32(x32, factor, axis, num_ranks, plan)
    else:
        y32 = _allreduce_f32(x32, factor, axis, num_ranks, plan)
    y = y32.reshape(shape).astype(dtype)
    if state is None:
        return y, None
    if plan.update == "separate":
        return y, _update_after(x, y, num_ranks, state, plan)
    new = comp.update_state(x32, y32, num_ranks, m, k)
    # The state carries no derivative on any path (the fused call's rule too): it is feedback
    # for the next call, not a function of x to differentiate.
    new = jax.tree.map(lax.stop_gradient, new)
    return y, comp.shaped_state(new, shape)


def _update_after(x, y, num_ranks, state, plan):
    """The separate update (`state_update="separate"`) on x, y and the state as the call read
    it: the transport's one-pass kernel where the plan says so (`CallPlan.separate_update`),
    else `compensator.update_beside` in JAX (on the GPU stream of ECHO_JAX_UPDATE_STREAM on
    GPUs). The same bits either way."""
    x, y = lax.stop_gradient(x), lax.stop_gradient(y)  # the state carries no derivative
    if plan.separate_update == "kernel":
        new = plan.transport.update_separate(x, y, state, num_ranks, plan.config)
    else:
        stream = comp.update_stream() if transports.base.on_gpu() else 0
        new = comp.update_beside(x, y, num_ranks, state,
                                 comp.Coefficients.from_config(plan.config), stream)
    return jax.tree.map(lax.stop_gradient, new)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _local_allreduce_f32(x_flat32, factor, axis, num_ranks, plan):
    """(y32, this rank's local residual u): `transports.xla.xla_allreduce_local`."""
    return _sealed(xla_allreduce_local, x_flat32, axis, num_ranks, plan.config,
                   factor=factor)


@_local_allreduce_f32.defjvp
def _local_allreduce_f32_jvp(axis, num_ranks, plan, primals, tangents):
    # Straight-through for y, as in `_allreduce_f32`; the residual feeds the state, which
    # carries no derivative.
    (x, factor), (t, _) = primals, tangents
    y, u = _local_allreduce_f32(x, factor, axis, num_ranks, plan)
    return (y, u), (lax.psum(t.astype(jnp.float32), axis), jnp.zeros_like(u))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _rotated_allreduce_f32(x_flat32, factor, axis, num_ranks, plan):
    """The quantized all-reduce in the rotated basis, returned in the original basis: the
    rotation in plain JAX around the transport (where the plan says rotation "jax").

    x times the factor (None: 1) is padded with zeros to whole groups, so that every Hadamard
    block is exactly one quantization group of the wire layout, and rotated
    (`transports.xla.rotated_allreduce`, the one JAX definition, also the reference of the custom
    calls' fused rotation). The sum comes from the configured transport (`_allreduce_f32`,
    custom call included, with rotation="none" so that it does not rotate again), is rotated
    back, divided by the factor and cut to x's length.
    """

    def reduce(xr, axis, num_ranks, plain, factor=None):
        del plain  # plan.config: the caller's config with rotation="none"
        return _allreduce_f32(xr, factor, axis, num_ranks, plan)

    return _sealed(rotated_allreduce, reduce, x_flat32, axis, num_ranks, plan.config, factor)


@_rotated_allreduce_f32.defjvp
def _rotated_allreduce_f32_jvp(axis, num_ranks, plan, primals, tangents):
    # Straight-through, as in `_allreduce_f32`: the rotation is orthogonal and linear and the
    # exact sum commutes with it, so the derivative is psum's exactly (not rotated round trips).
    # The factor is a constant of the derivative.
    (x, factor), (t, _) = primals, tangents
    return _rotated_allreduce_f32(x, factor, axis, num_ranks, plan), lax.psum(t, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _fused_allreduce_f32(x_flat32, m1, m2, factor, axis, num_ranks, plan):
    # x: flat fp32, bfloat16 or float16 (the sum comes back in its dtype); m1, m2: the state in
    # x's original shape and the state dtype (returned so); factor: None or the f32 power of two
    # of the rescaling. Only a plan with compensation "fused" gets here (`_echo_float`).
    return _sealed(plan.transport.allreduce_compensated, x_flat32, m1, m2, axis, num_ranks,
                   plan.config, factor=factor)


@_fused_allreduce_f32.defjvp
def _fused_allreduce_f32_jvp(axis, num_ranks, plan, primals, tangents):
    # Straight-through for x (as in `_allreduce_f32`, a 16-bit tangent summed in fp32); the
    # state and the factor carry no derivative.
    x, m1, m2, factor = primals
    y, n1, n2 = _fused_allreduce_f32(x, m1, m2, factor, axis, num_ranks, plan)
    t = tangents[0].astype(jnp.float32)
    return (y, n1, n2), (lax.psum(t, axis).astype(y.dtype), _zero_tangent(n1),
                         _zero_tangent(n2))


def _zero_tangent(tree):
    """Zero tangents for a state average (an int8 state's codes take float0 ones)."""
    def zero(a):
        if jnp.issubdtype(jnp.result_type(a), jnp.integer):
            return np.zeros(jnp.shape(a), jax.dtypes.float0)
        return jnp.zeros_like(a)
    return jax.tree.map(zero, tree)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _applied_allreduce_f32(x_flat32, m1, m2, factor, axis, num_ranks, plan):
    # As `_fused_allreduce_f32`, but the call only reads m1, m2 (the apply step) and returns y.
    return _sealed(plan.transport.allreduce_applied, x_flat32, m1, m2, axis, num_ranks,
                   plan.config, factor=factor)


@_applied_allreduce_f32.defjvp
def _applied_allreduce_f32_jvp(axis, num_ranks, plan, primals, tangents):
    # Straight-through for x, as in `_fused_allreduce_f32`; the state and the factor carry none.
    x, m1, m2, factor = primals
    y = _applied_allreduce_f32(x, m1, m2, factor, axis, num_ranks, plan)
    t = tangents[0].astype(jnp.float32)
    return y, lax.psum(t, axis).astype(y.dtype)


class _DefaultConfig:
    """The default of `echo_psum`'s `config`: the default `EchoConfig()` (4 bits), told apart
    from an explicit `config=None` (which is to mean the exact `lax.psum`)."""

    def __repr__(self):
        return "EchoConfig()"


_DEFAULT_CONFIG = _DefaultConfig()


def echo_psum(x, axis_name, *, config: EchoConfig | None = _DEFAULT_CONFIG, state=None,
              rescale: bool | str = "auto", axis_index_groups=None, return_state=None):
    """Sum `x` over the mesh or vmap axes `axis_name` with the Echo 4/8-bit all-reduce.

    A drop-in for `lax.psum(x, axis_name)` inside `jax.shard_map`, `jax.vmap(...,
    axis_name=...)` and `jax.pmap`: it takes what psum takes there and returns psum's result
    type (shape, dtype, weak type, varying mesh axes). Float leaves go through Echo (the Echo
    paper Sec. 4; every rank returns the same bits, every element is quantized at most twice);
    bool and integer leaves are summed exactly by `lax.psum` (bool -> int32, as psum does).
    With `state` the float leaves run the compensated all-reduce of Algorithm 1 (Sec. 5.1).
    docs/design.md ("The psum contract") has the table of what is exact, what is Echo and
    what is refused.

    Args:
      x: an array, a Python / NumPy scalar, or a pytree of them: this rank's contribution.
        float32, bfloat16 and float16 go into the protocol as they are; other floats (float64
        with jax_enable_x64, the 8-bit floats) are summed in fp32 and rounded back to their
        dtype. A Python float keeps its weak type, as in psum. Under vmap, a value not batched
        along the axis (in_axes=None, a closed-over constant, a Python scalar) is every rank's
        contribution (the sum is P * x, as psum's). Complex leaves raise a ValueError (use
        lax.psum, or sum the real and imaginary parts as two float leaves); leaves typed
        unreduced or reduced (explicit sharding) raise a ValueError that names the type and
        the fix.
      axis_name: the axis to reduce over, or a tuple of axis names: one Echo all-reduce over
        their product group, ranks in `lax.axis_index(axis_name)` order (first name major).
        Other mesh axes are left alone. A tuple of several names runs the "xla" transport (the
        custom call reduces over one mesh axis: "auto" picks "xla", "p2p" raises).
      config: an `EchoConfig`. Left out: the default `EchoConfig()` (4 bits, g = 128,
        zero-aware asym, transport "auto"), so `echo_psum(x, axis)` is Echo where
        `lax.psum(x, axis)` was. An explicit `config=None` still runs `EchoConfig()` but warns
        (`FutureWarning`): it is to mean the exact `lax.psum`, as `config=None` means in
        `echo_jax.tp`, the `echo_jax.gspmd` helpers and the Flax layers; pass
        `config=EchoConfig()` (or leave it out) for 4-bit Echo.
      state: None (uncompensated), or a `CompensatorState` (a pytree of them mirroring x, with
        None at the leaves that take none: bool / integer leaves always, any float leaf to
        leave it uncompensated) from `init_state(x)` or from the previous site.
      rescale: "auto" (default) and False: no rescaling. The wire format's group scales are
        bf16 (fp32's exponent range), so every finite contribution quantizes to finite values
        as it is: a group comes back NaN only where its max |x|, in x or in the sum of the P
        contributions, reaches 2^126 (about 8.5e37; fp32 psum overflows at 3.4e38), and a
        group's step is at least 2^-100, so values below about 2^-97 come back within about
        P * 2^-101 of their exact sum (half a step per quantization they pass through).
        True: multiply by a shared power of two before quantizing and divide after (the Echo
        paper Sec. 5.4), so that the call's max |x| lands in [256, 512) (lower where P > 64);
        it costs one read of x (its max) and one scalar pmax a call, and changes the bits only
        where a group meets the scale's floor or the 2^126 limit (the factor is exact, and an
        operand of the custom call, so the fused compensated path stays fused). With
        `config.rotation="hadamard"` the factor aims 2^ceil(log2(g) / 2) lower (the rotation
        can raise a value by up to sqrt(g)).
        NaN and +-inf: the 4-bit wire format has no code for them and a group holding one
        has no finite scale, so its g values of the sum are NaN on every rank (psum gives
        +-inf there where the other ranks' values are finite); the other groups are
        unaffected (they are left out of the rescaling's max too). Where an inf must survive
        (e.g. an overflow check), sum the check exactly: echo_psum of an int or bool leaf is
        lax.psum.
      axis_index_groups: psum's argument; only None is supported (Echo reduces over whole
        mesh axes): give the mesh an axis per group instead (e.g. split "tp" of size 8 into
        ("tpo", "tpi") of sizes (2, 4) and reduce over "tpi"), or use lax.psum.
      return_state: None (default): return y without `state`, (y, new_state) with it. True:
        always (y, new_state), new_state None when `state` is None, so one call site serves a
        compensated and an uncompensated configuration alike. False: always y (then `state`
        must be None).

    Returns:
      The sum, with psum's result type; (sum, new_state) with `state` or return_state=True.
      The new state mirrors `state` (its leaves typed varying over x's varying axes and the
      reduced axes, as `init_state(x, axis_name=...)` gives them, so it can be a `lax.scan` /
      `fori_loop` carry inside a type-checked `jax.shard_map`).

    Raises:
      NameError: an axis name that is not bound here, as psum raises (an `UnboundAxisError`,
        which is also a ValueError), naming the axis and the fix.
      ValueError: an integer axis name, an unsupported dtype or sharding type, a state that
        does not fit x, axis_index_groups, or transport "p2p" where it cannot run.

    Warns:
      FutureWarning: an explicit `config=None` (see `config`).
    """
    if config is None:
        warnings.warn(
            "echo_psum: config=None runs the default EchoConfig() (4-bit Echo) for now, but is "
            "to mean the exact lax.psum, as config=None means in echo_jax.tp, the "
            "echo_jax.gspmd helpers and the Flax layers. Pass config=echo_jax.EchoConfig() (or "
            "leave config out) for 4-bit Echo, or call lax.psum for the exact sum.",
            FutureWarning, stacklevel=2)
    if config is None or config is _DEFAULT_CONFIG:
        config = EchoConfig()
    if not isinstance(config, EchoConfig):
        raise ValueError(f"echo_psum: config must be an EchoConfig, got {type(config).__name__}")
    if axis_index_groups is not None:
        raise ValueError(
            "echo_psum: axis_index_groups is not supported: the Echo protocol reduces over whole "
            "mesh axes. Give the mesh one axis per group instead (e.g. split an axis 'tp' of "
            "size 8 into ('tpo', 'tpi') of sizes (2, 4) and reduce over 'tpi'), or use "
            "lax.psum(x, axis_name, axis_index_groups=...)")
    if return_state not in (None, True, False):
        raise ValueError(f"echo_psum: return_state must be None, True or False, got "
                         f"{return_state!r}")
    if return_state is False and state is not None:
        raise ValueError("echo_psum: return_state=False with a state would drop the updated "
                         "state; pass state=None, or return_state=True / None")
    pair = state is not None if return_state is None else return_state
    names = _axes(axis_name, "echo_psum")
    if not names:  # psum over no axes is the identity
        return (x, state) if pair else x
    axis = _axis_arg(names)
    axis_size(axis)  # a clear error before tracing anything else
    partial_manual.check(x, axis, "echo_psum")  # warns where XLA would gather x (gspmd)
    config = _config_for_axes(config, axis)
    rescale = check_rescale(rescale)
    leaves, treedef = jax.tree.flatten(x)
    if state is None:
        ys = [_echo_leaf(leaf, None, axis, config, rescale)[0] for leaf in leaves]
        y = jax.tree.unflatten(treedef, ys)
        return (y, None) if pair else y
    try:
        states = treedef.flatten_up_to(state)
    except (ValueError, TypeError) as err:
        raise ValueError("echo_psum: state must mirror x's pytree with a CompensatorState per "
                         "float array and None per bool / integer one (use init_state(x)): "
                         f"{err}") from None
    pairs = [_echo_leaf(leaf, s, axis, config, rescale) for leaf, s in zip(leaves, states)]
    return (jax.tree.unflatten(treedef, [p[0] for p in pairs]),
            jax.tree.unflatten(treedef, [p[1] for p in pairs]))


__all__ = ["echo_psum", "UnboundAxisError", "xla_allreduce", "segment_layout",
           "resolve_transport", "power_of_two_scale", "rescale_factor",
           "rotation_headroom_log2", "rescale_ceiling",
           "check_rescale", "xla_allreduce_scaled", "RESCALE_MODES",
           "RESCALE_TOP_LOG2", "FORCE_XLA_ENV"]
