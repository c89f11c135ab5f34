"""Echo in a jit program whose arrays carry shardings: Megatron's two sites as helpers.

Most JAX tensor-parallel code is a jit program whose arrays carry `NamedSharding`s (Flax's
sharding guide, MaxText): the weights are sharded over "tp", the batch over "dp" / "fsdp", and XLA
inserts the all-reduce of a row-parallel layer itself. Echo (the Echo paper, arXiv 2610.14277,
Sec. 4 and 5) replaces that all-reduce where these helpers run the two Megatron sites (Sec. 5.4):

* `row_parallel_matmul(x, w)`: x [..., K] with K sharded over `axis`, w [K, N] with K sharded
  over `axis`; the local contraction, then the Echo all-reduce of the partial sums over `axis`
  (`echo_jax.tp.forward_site`: Echo forward, identity backward). The result [..., N] is
  replicated over `axis`, its leading dims sharded as x's.
* `column_parallel_matmul(x, w)`: x [..., K] replicated over `axis`, w [K, N] with N sharded over
  `axis`; identity forward, and the Echo all-reduce of x's cotangent backward
  (`echo_jax.tp.backward_site`). The result [..., N] is sharded over `axis` on its last dim.

Each builds one `jax.shard_map` that is manual over every mesh axis of size > 1 (not only over
`axis`): a shard_map manual over "tp" alone leaves the batch axes automatic, and XLA then gathers
the contribution across them before the exchange (`echo_jax.partial_manual`), while a fully
manual one hands every device its own batch shard and lets the Echo custom call run.

Where the layouts come from (`operand_specs`): under Explicit mesh axes (`jax.sharding.AxisType`)
from the operands' types (`jax.typeof(x).sharding.spec`). Under Auto axes a traced array carries
no sharding yet (XLA propagates it later), so the helpers lay the operands out as Megatron's
layer does: x's first dim over every other mesh axis of size > 1 (the batch axes,
`batch_axes`), K (row) or N (column) of w over `axis`; the same outside jit (a concrete array's
sharding is not read, so that eager and jit calls agree). `x_spec=` / `w_spec=` name another
layout; XLA reshards an operand that arrives otherwise (inside the program, before the site).

Fallback (never silent): where the contraction (row) or w's output dim (column) is not sharded
over `axis`, or `axis` appears where Megatron's layout has no place for it, the helper runs the
plain `jnp.dot` (XLA's own collectives) and warns once with the reason (`EchoShardingWarning`).
A mesh whose `axis` has size 1 runs the plain dot too (there is nothing to reduce), without a
warning.

FSDP: every mesh axis other than `axis` that shards w (e.g. w [K, N] over ("tp", "fsdp")) is
all-gathered inside the shard_map before the contraction (what FSDP means; its transpose is the
reduce-scatter of w's gradient). On w's `axis` dim, `axis` must be the major entry (("tp",
"fsdp"), not ("fsdp", "tp")), so that the gathered block is the contiguous K / P slice x holds.

Compensator state (`state_for`): the state of a site is per rank and shaped like the reduced
value (the row site's output, the column site's input x), so its global array is [P, ...]:
stacked over `axis` on a new leading dim, the other dims sharded as the reduced value's. With a
state the helpers return (y, new_state); the column site returns the state unchanged and the
backward pass carries the live state as its cotangent (as `echo_jax.tp.backward_site`).

`config=None` is the exact baseline through the same code: `lax.psum`.
"""

from __future__ import annotations

import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from echo_jax import _compat, policies, tp
from echo_jax import compensator as comp
from echo_jax.compensator import CompensatorState
from echo_jax.config import EchoConfig
from echo_jax.partial_manual import EchoShardingWarning, auto_axes_beside
from echo_jax.partial_manual import check as check_partial_manual

# --------------------------------------------------------------------------------------------
# meshes and specs


class EchoMeshWarning(EchoShardingWarning):
    """A tensor-parallel site whose weight lives on a mesh runs without Echo because no mesh is
    set where it is traced: a `jax.jit` / `nnx.jit` step called outside `with
    jax.set_mesh(mesh):` (jit does not hand the arguments' mesh to the program), so the site is
    the plain contraction and XLA all-reduces it itself. The message names the fix. A subclass
    of `EchoShardingWarning`, so that a filter on either turns it into an error."""


def type_mesh(a):
    """The mesh an array's type names, or None: a concrete array's `NamedSharding` mesh, or,
    for a value traced by `jax.jit`, the mesh of the argument it came from (its type keeps the
    mesh even where no mesh is set; an Auto axis's entries of the spec are dropped)."""
    try:
        sharding = jax.typeof(a).sharding
    except (TypeError, AttributeError):
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    return mesh


def mesh_hint(axis, *arrays) -> str:
    """The fix where no mesh is set but an operand's type names one with `axis` (else "")."""
    for a in arrays:
        mesh = type_mesh(a)
        if mesh is not None and axis in mesh.axis_names:
            sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
            return (f"the operands live on a mesh {sizes}, but no mesh is set where this runs "
                    "(jax.jit and nnx.jit do not hand the arguments' mesh to the program): call "
                    "the step under `with jax.set_mesh(mesh):` with that mesh")
    return ""


def _resolve_mesh(mesh, *arrays, where):
    """The mesh to shard over: `mesh`, else the one of `jax.set_mesh`, else a concrete operand's."""
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        if getattr(abstract, "manual_axes", ()):
            return abstract  # inside a shard_map: the nested one goes over the remaining axes
        concrete = _compat.concrete_mesh()
        return concrete if concrete is not None and not concrete.empty else abstract
    for a in arrays:
        sharding = getattr(a, "sharding", None)
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) \
                and isinstance(sharding, NamedSharding):
            return sharding.mesh
    for a in arrays:
        mesh = type_mesh(a)
        if mesh is not None:
            sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
            raise ValueError(
                f"{where}: no mesh is set: the operands live on a mesh {sizes}, but jax.jit "
                "(and nnx.jit) do not hand the arguments' mesh to the program. Call the step "
                "under `with jax.set_mesh(mesh):` with that mesh (or pass mesh=...)")
    raise ValueError(f"{where}: no mesh: call it under `with jax.set_mesh(mesh):`, or pass "
                     "mesh=... (or, outside jit, operands that carry a NamedSharding)")


def _entries(spec, ndim: int) -> tuple:
    """A PartitionSpec as one tuple of axis names per dim (padded with () to ndim)."""
    out = []
    for e in tuple(spec)[:ndim]:
        if e is None or e is PartitionSpec.UNCONSTRAINED:
            out.append(())
        elif isinstance(e, (tuple, list)):
            out.append(tuple(e))
        else:
            out.append((e,))
    return tuple(out) + ((),) * (ndim - len(out))


def _spec(entries) -> PartitionSpec:
    return PartitionSpec(*(None if not e else (e[0] if len(e) == 1 else tuple(e))
                           for e in entries))


def _free_axes(mesh) -> tuple:
    """Mesh axes that are not manual already (the ones a new shard_map takes: all of them)."""
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return tuple(n for n in mesh.axis_names if n not in manual)


def batch_axes(mesh, axis="tp") -> tuple:
    """The axes the Megatron layout shards the batch over: every mesh axis of size > 1 other
    than `axis` (not manual already), in mesh order, e.g. ("dp",) or ("fsdp",)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return tuple(a for a in _free_axes(mesh) if a != axis and sizes[a] > 1)


def _known_spec(a, mesh):
    """The operand's PartitionSpec where its type carries one: under Explicit mesh axes
    (`jax.typeof(a).sharding`); None under Auto axes, where a traced array carries no sharding
    yet (and a concrete array's is not read either, so that eager and jit calls agree)."""
    del mesh
    try:
        sharding = jax.typeof(a).sharding
    except (TypeError, AttributeError):
        return None
    spec_mesh = getattr(sharding, "mesh", None)
    if spec_mesh is not None and not spec_mesh.empty and getattr(spec_mesh, "explicit_axes", ()):
        return sharding.spec
    return None


def _default_value_entries(ndim, mesh, axis):
    """Megatron's layout of an activation: the first dim over the batch axes (if ndim >= 2)."""
    batch = batch_axes(mesh, axis)
    if ndim >= 2 and batch:
        return (batch,) + ((),) * (ndim - 1)
    return ((),) * ndim


def operand_specs(x, w, *, axis="tp", kind="row", mesh=None, x_spec=None, w_spec=None):
    """The PartitionSpecs the helpers use for x and w (`row_parallel_matmul`'s layout rule).

    Args:
      x: the activation [..., K] (an array or a ShapeDtypeStruct).
      w: the weight [K, N].
      axis: the tensor-parallel mesh axis.
      kind: "row" (K over `axis`) or "column" (N over `axis`).
      mesh: the mesh (default: `jax.set_mesh`'s, or a concrete operand's).
      x_spec, w_spec: given layouts (override what is read).

    Returns:
      (x_spec, w_spec) as PartitionSpecs of x's and w's rank.
    """
    if kind not in ("row", "column"):
        raise ValueError(f"operand_specs: kind must be 'row' or 'column', got {kind!r}")
    mesh = _resolve_mesh(mesh, x, w, where="operand_specs")
    xe, we = _operand_entries(x, w, axis, kind, mesh, x_spec, w_spec)
    return _spec(xe), _spec(we)


def _operand_entries(x, w, axis, kind, mesh, x_spec, w_spec):
    ndim = len(jnp.shape(x))
    if x_spec is None:
        x_spec = _known_spec(x, mesh)
    if x_spec is None:
        xe = _default_value_entries(ndim, mesh, axis)
        if kind == "row":
            xe = xe[:-1] + ((axis,),)
    else:
        xe = _entries(x_spec, ndim)
    if w_spec is None:
        w_spec = _known_spec(w, mesh)
    if w_spec is None:
        we = ((axis,), ()) if kind == "row" else ((), (axis,))
    else:
        we = _entries(w_spec, 2)
    return xe, we


def _layout_problem(xe, we, axis, kind):
    """Why the layout is not Megatron's row / column-parallel one over `axis` (None if it is)."""
    site_dim = 0 if kind == "row" else 1  # w's dim that `axis` shards
    x_site = xe[-1] if kind == "row" else ()
    what = "the contraction dim (x's last, w's first)" if kind == "row" \
        else "w's output dim (its last)"
    if axis not in we[site_dim]:
        return f"{what} is not sharded over {axis!r}"
    if we[site_dim][0] != axis:
        fixed = (axis,) + tuple(a for a in we[site_dim] if a != axis)
        return (f"w's dim {site_dim} is sharded over {we[site_dim]}, with {axis!r} not the major "
                f"entry; put {axis!r} first ({fixed})")
    if axis in we[1 - site_dim]:
        return f"w is sharded over {axis!r} on both dims"
    if kind == "row" and x_site != (axis,):
        return (f"x's last dim is sharded over {x_site or 'no axis'}, not exactly over "
                f"{axis!r} as w's first dim is")
    if kind == "column" and xe[-1]:
        return f"x's last dim (the contraction) is sharded over {xe[-1]}; it must be whole"
    for i, e in enumerate(xe[:-1]):
        if axis in e:
            return f"x's dim {i} is sharded over {axis!r}"
    return None


def _check_divisible(name, shape, entries, mesh, where):
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    for d, (n, e) in enumerate(zip(shape, entries)):
        for a in e:
            if a not in sizes:
                raise ValueError(f"{where}: {name}'s spec names axis {a!r}, which the mesh "
                                 f"{dict(sizes)} does not have")
        k = math.prod(sizes[a] for a in e)
        if n % k:
            raise ValueError(
                f"{where}: {name}'s dim {d} (size {n}) is sharded over {e} ({k} shards), which "
                f"does not divide it; pass {name}_spec=... with a layout that divides it (e.g. "
                f"that dim unsharded)")


def _fallback(where, reason, x, w, state, precision, preferred_element_type):
    warnings.warn(f"{where}: {reason}; running the plain jnp.dot (XLA's own collectives, no "
                  "Echo). Shard it as Megatron's layer does (see docs/jit.md) to use Echo.",
                  EchoShardingWarning, stacklevel=4)
    y = jnp.dot(x, w, precision=precision, preferred_element_type=preferred_element_type)
    return y if state is None else (y, state)


def _gather_w(wl, we, axis):
    """All-gathers w's local block over every mesh axis of its spec but `axis` (FSDP), typed
    invariant over them (the gathered block is the same on every rank of those axes)."""
    for d, e in enumerate(we):
        others = tuple(a for a in e if a != axis)
        if others:
            names = others if len(others) > 1 else others[0]
            to = "invarying" if _compat.varying_axes(wl) >= set(others) else "varying"
            wl = lax.all_gather(wl, names, axis=d, tiled=True, to=to)
    return wl


def _check_common(where, x, w, config, axis):
    tp.check_site_configs(config, where)
    if jnp.ndim(w) != 2:
        raise ValueError(f"{where}: w must be a matrix [K, N], got shape {jnp.shape(w)}")
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(f"{where}: x's last dim must match w's first: x {jnp.shape(x)}, w "
                         f"{jnp.shape(w)}")
    if isinstance(axis, (tuple, list)):
        raise ValueError(f"{where}: axis must be one mesh axis name, got {axis!r}")


def _site_state_entries(value_entries, axis):
    return ((axis,),) + tuple(value_entries)


def _state_in(state, where):
    if not isinstance(state, CompensatorState):
        raise ValueError(f"{where}: state must be a CompensatorState of global [P, ...] arrays "
                         f"(use echo_jax.gspmd.state_for), got {type(state).__name__}")
    return state


#: How to make a site's state with `state_for`, per site (the call a message shows).
_STATE_CALL = {
    "row": "echo_jax.gspmd.state_for(x.shape[:-1] + (w.shape[-1],), axis={axis!r}, "
           "config=config)  # shaped like y",
    "column": "echo_jax.gspmd.state_for(x.shape, axis={axis!r}, config=config)  # shaped like x",
}


def _check_state_shape(state, value_shape, p, kind, axis, where):
    """A ValueError naming `state_for` and the right call unless the state is [P, *value]."""
    want = (p,) + tuple(value_shape)
    value = "y" if kind == "row" else "x"
    for name in ("m1", "m2"):
        moment = getattr(state, name)
        have = tuple(jnp.shape(getattr(moment, "codes", moment)))
        if have == want:
            continue
        per_rank = (" (a per-rank state, as echo_jax.init_state makes for shard_map code)"
                    if len(have) == len(want) - 1 else "")
        raise ValueError(
            f"{where}: the state's {name} is shaped {have}{per_rank}, but this site's state is "
            f"global: [P, *{value}.shape] = {want}, P = {p} the size of {axis!r}, {value} the "
            f"value this site reduces. Make it with echo_jax.gspmd.state_for: state = "
            + _STATE_CALL[kind].format(axis=axis))


#: What to call instead where `axis` is already manual (the message of each site's error).
_MANUAL_HINT = {
    "row": "echo_jax.tp.forward_site / echo_psum on the partial sum",
    "column": "echo_jax.tp.backward_site on x",
}


def _site_matmul(where, kind, body, x, w, *, axis, config, state, mesh, choice, x_spec, w_spec,
                 precision, preferred_element_type):
    """One site of `row_parallel_matmul` / `column_parallel_matmul` (`kind` "row" or "column"):
    the checks and the layout, then `body(xl, wl, st, ch)` (wl this rank's block of w,
    all-gathered over w's other axes: FSDP) as one shard_map manual over every free mesh axis.
    Where the site does not run, the plain dot (a fallback that warns, or `axis` of size 1).

    Returns:
      y, or (y, new_state) with a state.
    """
    _check_common(where, x, w, config, axis)
    mesh = _resolve_mesh(mesh, x, w, where=where)
    if state is not None:
        _state_in(state, where)
    if axis not in mesh.axis_names:
        return _fallback(where, f"the mesh {tuple(mesh.axis_names)} has no axis {axis!r}", x, w,
                         state, precision, preferred_element_type)
    if axis in (getattr(mesh, "manual_axes", ()) or ()):
        raise ValueError(f"{where}: axis {axis!r} is already manual here (inside a shard_map over "
                         f"it); in shard_map code call {_MANUAL_HINT[kind]} instead")
    if dict(zip(mesh.axis_names, mesh.axis_sizes))[axis] == 1:
        y = jnp.dot(x, w, precision=precision, preferred_element_type=preferred_element_type)
        return y if state is None else (y, state)
    xe, we = _operand_entries(x, w, axis, kind, mesh, x_spec, w_spec)
    problem = _layout_problem(xe, we, axis, kind)
    if problem is not None:
        return _fallback(where, f"{problem} (x: {_spec(xe)}, w: {_spec(we)})", x, w, state,
                         precision, preferred_element_type)
    _check_divisible("x", jnp.shape(x), xe, mesh, where)
    _check_divisible("w", jnp.shape(w), we, mesh, where)
    if state is not None:
        value_shape = jnp.shape(x)[:-1] + (jnp.shape(w)[-1],) if kind == "row" else jnp.shape(x)
        p = dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]
        _check_state_shape(state, value_shape, p, kind, axis, where)
    # y: replicated over `axis` (row) or sharded over it on its last dim (column); the state is
    # shaped like the reduced value: y (row), x (column).
    ye = xe[:-1] + (((),) if kind == "row" else ((axis,),))
    se = _site_state_entries(ye if kind == "row" else xe, axis)

    def gathered(xl, wl, st, ch):
        return body(xl, _gather_w(wl, we, axis), st, ch)

    state_specs = None if state is None else CompensatorState(_spec(se), _spec(se))
    f = jax.shard_map(gathered, mesh=mesh, axis_names=set(_free_axes(mesh)),
                      in_specs=(_spec(xe), _spec(we), state_specs,
                                None if choice is None else PartitionSpec()),
                      out_specs=(_spec(ye), state_specs))
    y, new = f(x, w, state, choice)
    return y if state is None else (y, new)


# --------------------------------------------------------------------------------------------
# the row-parallel site (Megatron's g after the row-parallel matmul)


def row_parallel_matmul(x, w, *, axis="tp", config=None, state=None, mesh=None, choice=None,
                        rescale=False, x_spec=None, w_spec=None, precision=None,
                        preferred_element_type=None):
    """x @ w for a row-parallel layer, the partial sums reduced over `axis` by Echo.

    The forward site of Megatron's row-parallel layer (the Echo paper Sec. 5.4): every rank
    contracts its K / P slice of x with its K / P rows of w, and the partial sums are all-reduced
    over `axis` (`echo_jax.tp.forward_site`: Echo forward, identity backward; straight-through
    gradients). One shard_map, manual over every mesh axis of size > 1.

    Args:
      x: [..., K], K sharded over `axis`, the leading dims over any other axes (the batch axes).
      w: [K, N], K sharded over `axis` (major entry); other axes on w are all-gathered (FSDP).
      axis: the tensor-parallel mesh axis.
      config: an `EchoConfig`, None (the exact `lax.psum`), or a tuple of them picked per layer
        by `choice` (`echo_jax.tp`).
      state: None, or the site's `CompensatorState` of global [P, ..., N] arrays
        (`state_for(y)`).
      mesh: the mesh (default: the one of `jax.set_mesh`, else a concrete operand's).
      choice: an int index into a tuple `config` (may be traced).
      rescale: the power-of-two rescaling around the all-reduce (off in the forward, as the
        paper's).
      x_spec, w_spec: the operands' PartitionSpecs where they cannot be read (Auto axes inside
        jit; see the module docstring).
      precision, preferred_element_type: as `jnp.dot`'s.

    Returns:
      y [..., N] replicated over `axis` (the leading dims sharded as x's); with `state`,
      (y, new_state). Falls back to `jnp.dot` with an `EchoShardingWarning` where the layout is
      not row-parallel over `axis`.
    """
    def body(xl, wl, st, ch):
        part = jnp.dot(xl, wl, precision=precision, preferred_element_type=preferred_element_type)
        s = None if st is None else CompensatorState(st.m1[0], st.m2[0])
        y, s = tp.forward_site(part, axis, config, s, choice=ch, rescale=rescale)
        if st is None:
            return y, None
        return y, CompensatorState(s.m1[None], s.m2[None])

    return _site_matmul("row_parallel_matmul", "row", body, x, w, axis=axis, config=config,
                        state=state, mesh=mesh, choice=choice, x_spec=x_spec, w_spec=w_spec,
                        precision=precision, preferred_element_type=preferred_element_type)


# --------------------------------------------------------------------------------------------
# the column-parallel site (Megatron's f before the column-parallel matmul)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _column_input(x, choice, axis, config, rescale):
    return _compat.to_varying(x, axis)


def _column_input_fwd(x, choice, axis, config, rescale):
    return _column_input(x, choice, axis, config, rescale), (choice,)


def _column_input_bwd(axis, config, rescale, res, ct):
    (choice,) = res
    ct_x, _ = tp.site_all_reduce(ct, axis, config, choice, None, rescale)
    return ct_x, tp.choice_cotangent(choice)


_column_input.defvjp(_column_input_fwd, _column_input_bwd)


def column_parallel_matmul(x, w, *, axis="tp", config=None, state=None, mesh=None, choice=None,
                           rescale=True, x_spec=None, w_spec=None, precision=None,
                           preferred_element_type=None):
    """x @ w for a column-parallel layer; x's cotangent is reduced over `axis` by Echo.

    The backward site of Megatron's column-parallel layer (the Echo paper Sec. 5.4): the forward
    pass multiplies the replicated x by each rank's N / P columns of w (no communication); the
    backward pass all-reduces the partial cotangents of x over `axis` with Echo
    (`echo_jax.tp.backward_site`), rescaled by a shared power of two by default. One shard_map,
    manual over every mesh axis of size > 1.

    Args:
      x: [..., K], replicated over `axis` (its leading dims over any other axes, its last dim
        whole).
      w: [K, N], N sharded over `axis` (major entry); other axes on w are all-gathered (FSDP).
      axis: the tensor-parallel mesh axis.
      config: an `EchoConfig`, None (the exact `lax.psum`), or a tuple picked by `choice`.
      state: None, or the backward `CompensatorState` of global [P, ..., K] arrays
        (`state_for(x)`): returned unchanged; its cotangent (its gradient) is the backward
        state after this site, in backward order, as `echo_jax.tp.backward_site`.
      mesh, choice, x_spec, w_spec, precision, preferred_element_type: as
        `row_parallel_matmul`'s.
      rescale: the power-of-two rescaling of the cotangent (on by default, Sec. 5.4).

    Returns:
      y [..., N] with N sharded over `axis` (the leading dims as x's); with `state`,
      (y, state). Falls back to `jnp.dot` with an `EchoShardingWarning` where w's output dim
      is not sharded over `axis`.
    """
    def body(xl, wl, st, ch):
        if st is None:
            xin = _column_input(xl, ch, axis, config, rescale)
            out = None
        else:
            s = CompensatorState(st.m1[0], st.m2[0])
            xin, s = tp.backward_site(xl, axis, config, s, choice=ch, rescale=rescale)
            out = CompensatorState(s.m1[None], s.m2[None])
        y = jnp.dot(xin, wl, precision=precision, preferred_element_type=preferred_element_type)
        return y, out

    return _site_matmul("column_parallel_matmul", "column", body, x, w, axis=axis,
                        config=config, state=state, mesh=mesh, choice=choice, x_spec=x_spec,
                        w_spec=w_spec, precision=precision,
                        preferred_element_type=preferred_element_type)


# --------------------------------------------------------------------------------------------
# the compensator state's global layout


def state_for(value, *, axis="tp", mesh=None, spec=None, config: EchoConfig | None = None,
              dtype=None) -> CompensatorState:
    """The zero compensator state of one Echo site, as global arrays with the right sharding.

    The state is per rank and shaped like the value the site reduces (the row site's output y,
    the column site's input x), so its global array is [P, *value.shape]: stacked over `axis` on
    a new leading dim, the other dims sharded as the value's (`spec`). Pass it to
    `row_parallel_matmul(..., state=)` / `column_parallel_matmul(..., state=)`.

    Args:
      value: the reduced value: an array, a ShapeDtypeStruct or a shape tuple (row site:
        x.shape[:-1] + (N,); column site: x's shape).
      axis: the tensor-parallel mesh axis (P = its size).
      mesh: the mesh (default: `jax.set_mesh`'s, or value's if it is a concrete array).
      spec: the value's PartitionSpec (default: read from `value` where known, else the
        Megatron layout: the first dim over the batch axes, `batch_axes(mesh, axis)`). It must
        not name `axis` (the reduced value is replicated over it).
      config: the sites' EchoConfig: the state is made in its `state_dtype`.
      dtype: the state dtype instead of (or agreeing with) config's.

    Returns:
      CompensatorState(m1, m2) of zeros [P, *shape], sharded PartitionSpec(axis, *spec).
    """
    where = "state_for"
    if isinstance(value, (tuple, list)) and all(isinstance(d, int) for d in value):
        shape, arr = tuple(int(d) for d in value), None
    else:
        shape, arr = tuple(jnp.shape(value)), value
    mesh = _resolve_mesh(mesh, *(() if arr is None else (arr,)), where=where)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if axis not in sizes:
        raise ValueError(f"{where}: the mesh {tuple(mesh.axis_names)} has no axis {axis!r}")
    if spec is None and arr is not None:
        spec = _known_spec(arr, mesh)
    entries = _default_value_entries(len(shape), mesh, axis) if spec is None \
        else _entries(spec, len(shape))
    if any(axis in e for e in entries):
        raise ValueError(f"{where}: the reduced value is replicated over {axis!r}, but its spec "
                         f"{_spec(entries)} names it")
    _check_divisible("value", shape, entries, mesh, where)
    dt = comp.state_dtype(config, dtype)
    if dt in comp.STATE_LEVELS:
        raise ValueError(
            f"{where}: EchoConfig.state_dtype={dt.name!r} runs with echo_psum and the echo_jax.tp "
            "forward sites inside jax.shard_map, not yet with the jit / GSPMD helpers (its "
            "per-group scales are not laid out for a sharded state); use state_dtype='float32' "
            "or 'bfloat16' here")
    gshape = (sizes[axis],) + shape
    gspec = _spec(_site_state_entries(entries, axis))
    if getattr(mesh, "are_all_axes_explicit", False):
        z = jnp.zeros(gshape, dt, out_sharding=NamedSharding(mesh, gspec))
    else:
        z = lax.with_sharding_constraint(jnp.zeros(gshape, dt), NamedSharding(mesh, gspec))
    return CompensatorState(z, z)


# --------------------------------------------------------------------------------------------
# reading a compiled program


def _group_size(groups: str) -> int:
    """Ranks per replica group from an HLO replica_groups text (0 where it is not read)."""
    m = re.match(r"\[([\d,]+)\]<=", groups)                  # iota: [groups, size]<=[...]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.match(r"\{\{([\d,]*)\}", groups)                # explicit: {{0,1,2,3},...}
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", groups)  # mesh['dp'=2,'tp'=4] {'tp'}
    if m:
        sizes = {k.strip("' "): int(v) for k, v in
                 (kv.split("=") for kv in m.group(1).split(",") if "=" in kv)}
        return math.prod(sizes.get(a.strip("' "), 1) for a in m.group(2).split(",") if a.strip())
    return 0


def collective_ops(hlo_text: str) -> list:
    """The collectives and Echo custom calls of a compiled HLO module's text.

    Args:
      hlo_text: `jax.jit(f).lower(...).compile().as_text()`.

    Returns:
      A list of dicts, in program order: op ("all-reduce", "all-gather", "all-to-all",
      "reduce-scatter", "collective-permute", or "echo" for an Echo custom call), target (the
      custom call's target, else ""), shapes (list of (dtype, dims) of the result), bytes (the
      result's bytes: shape x dtype size), groups (the replica_groups text), ranks (ranks per
      group; for an Echo call its num_ranks; 0 where not read) and wire_bytes (an estimate of
      the bytes one rank sends: a ring all-reduce 2 (G-1)/G x bytes, an all-gather or
      all-to-all (G-1)/G x bytes, a reduce-scatter (G-1) x bytes, a permute its bytes; an Echo
      call its push and gather, 2 (P-1) segments of quantized codes with their 16-bit group
      parameters, the Echo paper Sec. 4.1 and 4.3).
    """
    sizes = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
    op_re = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(all-reduce|all-gather|"
                       r"all-to-all|reduce-scatter|collective-permute|custom-call)(-start)?\(")
    names = {code: name for name, code in policies.CODES.items()}
    out = []
    for line in hlo_text.splitlines():
        m = op_re.match(line)
        if m is None:
            continue
        types, op = m.group(1), m.group(2)
        target = ""
        if op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            target = t.group(1) if t else ""
            if not target.startswith("echo_allreduce"):
                continue
            op = "echo"
        shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
                  for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", types)
                  if dt in sizes]
        if m.group(3) and len(shapes) > 1:  # an async start's tuple holds its operands too
            shapes = shapes[len(shapes) // 2:]
        nbytes = sum(sizes[dt] * math.prod(dims) for dt, dims in shapes)
        g = re.search(r"replica_groups=(\S+(?: \{[^}]*\})?)", line)
        groups = g.group(1).rstrip(",") if g else ""
        ranks, wire = _group_size(groups), 0.0
        if op == "echo":
            attrs = dict(re.findall(r"(\w+) = (-?\d+) : i64", line))
            if {"num_ranks", "bits", "group_size", "segment_groups", "policy"} <= set(attrs):
                ranks = int(attrs["num_ranks"])
                gsize = int(attrs["group_size"])
                bits = policies.wire_bits_per_element(int(attrs["bits"]), gsize,
                                                      names.get(int(attrs["policy"]), "asym"))
                seg = int(attrs["segment_groups"]) * gsize
                wire = 2 * (ranks - 1) * seg * bits / 8
        elif ranks:
            factor = {"all-reduce": 2 * (ranks - 1) / ranks, "all-gather": (ranks - 1) / ranks,
                      "all-to-all": (ranks - 1) / ranks, "reduce-scatter": ranks - 1,
                      "collective-permute": 1}[op]
            wire = factor * nbytes
        out.append(dict(op=op, target=target, shapes=shapes, bytes=nbytes, groups=groups,
                        ranks=ranks, wire_bytes=wire))
    return out


__all__ = ["row_parallel_matmul", "column_parallel_matmul", "state_for", "operand_specs",
           "batch_axes", "collective_ops", "type_mesh", "mesh_hint", "EchoShardingWarning",
           "EchoMeshWarning", "auto_axes_beside", "check_partial_manual"]
