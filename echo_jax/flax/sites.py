"""The sites of the Flax layers, Flax-free: where a layer runs, its site on a kernel, its state.

What `echo_jax.flax.linen` and `echo_jax.flax.nnx` share below their modules (re-exported by
`echo_jax.flax`, whose docstring tells the modes and site configs):

* where a layer runs: `resolve_mode` ("shard_map", "gspmd" or "local"), `axis_bound`,
  `axis_size`;
* the compensator state of one pass: `state_dtype`, `zero_state`, `check_state`;
* Megatron's two sites on a kernel (the Echo paper, arXiv 2610.14277, Sec. 5.4):
  `column_parallel` (f), `row_parallel` (g); `site_with_carrier` threads a carrier's state
  through one;
* the parameters of a layer initialized per rank: `sharded_init`, `split_features`.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from echo_jax import collective, gspmd, tp
from echo_jax.compensator import CompensatorState, QuantizedMoment, init_state
from echo_jax.config import EchoConfig

#: The layers' `mode` values.
MODES = ("auto", "shard_map", "gspmd")

SiteConfigs = Union[Optional[EchoConfig], Sequence[Optional[EchoConfig]]]


# --------------------------------------------------------------------------------------------
# where a layer runs


def axis_bound(axis_name) -> bool:
    """Whether `axis_name` is bound here (inside `jax.shard_map` over it, or `jax.vmap` with it)."""
    try:
        lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def _mesh_with(axis_name, arrays=()):
    """The mesh a "gspmd" site would use (None where there is none)."""
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        return abstract
    for a in arrays:
        sharding = getattr(a, "sharding", None)
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) \
                and isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _warn_unset_mesh(axis_name, arrays, where):
    """An `EchoMeshWarning` where an operand traced by jit lives on a mesh whose `axis_name`
    has more than one device but no mesh is set: the layer runs as the plain dense layer and
    XLA all-reduces it itself (a jit step called outside `jax.set_mesh`)."""
    for a in arrays:
        if not isinstance(a, jax.core.Tracer):
            continue
        mesh = gspmd.type_mesh(a)
        sizes = {} if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes))
        if sizes.get(axis_name, 1) > 1:
            warnings.warn(
                f"{where}: the kernel lives on a mesh {sizes} whose {axis_name!r} has "
                f"{sizes[axis_name]} devices, but no mesh is set where the layer is traced "
                "(jax.jit and nnx.jit do not hand the arguments' mesh to the program), so the "
                "layer runs as the plain dense layer and XLA all-reduces it itself, without "
                "Echo. Call the step under `with jax.set_mesh(mesh):` with that mesh (or name "
                "mode='gspmd' to make this an error).", gspmd.EchoMeshWarning, stacklevel=2)
            return


def resolve_mode(mode: str, axis_name: str, *arrays, where: str = "echo_jax.flax") -> str:
    """Where a layer runs: "shard_map", "gspmd" or "local" (the modes of `echo_jax.flax`).

    Args:
      mode: "auto", "shard_map" or "gspmd".
      axis_name: the tensor-parallel axis (a mesh axis name).
      *arrays: the operands (a concrete kernel's `NamedSharding` names a mesh).
      where: the caller, for messages.

    Returns:
      "shard_map", "gspmd" or "local" ("auto" only: no mesh and no bound axis).

    Raises:
      ValueError: an unknown mode, "shard_map" where the axis is not bound, "gspmd" inside a
        shard_map over the axis or without a mesh.

    Warns:
      EchoMeshWarning: "auto" resolves to "local" inside jit while an operand lives on a mesh
        whose `axis_name` has more than one device (a jit step called outside `jax.set_mesh`:
        the layer would run as the plain dense layer, XLA's all-reduce instead of Echo).
    """
    if mode not in MODES:
        raise ValueError(f"{where}: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(axis_name, str):
        raise ValueError(f"{where}: axis_name must be one mesh axis name, got {axis_name!r}")
    bound = axis_bound(axis_name)
    if mode == "shard_map":
        if not bound:
            raise ValueError(f"{where}: mode='shard_map' needs the axis {axis_name!r} bound: call "
                             f"the model inside jax.shard_map over a mesh with an axis "
                             f"{axis_name!r} (or jax.vmap(..., axis_name={axis_name!r}))")
        return "shard_map"
    if mode == "gspmd":
        if bound:
            raise ValueError(f"{where}: mode='gspmd' inside a shard_map (or vmap) over "
                             f"{axis_name!r}: per-rank code takes mode='shard_map' (or 'auto')")
        if _mesh_with(axis_name, arrays) is None:
            hint = gspmd.mesh_hint(axis_name, *arrays)
            raise ValueError(f"{where}: mode='gspmd' needs a mesh: "
                             + (hint or "call the model under `with jax.set_mesh(mesh):`"))
        return "gspmd"
    if bound:
        return "shard_map"
    if _mesh_with(axis_name, arrays) is not None:
        return "gspmd"
    _warn_unset_mesh(axis_name, arrays, where)
    return "local"


def axis_size(mode: str, axis_name: str, *arrays) -> int:
    """P: the size of `axis_name` in a resolved mode (1 for "local").

    Args:
      mode: a resolved mode ("shard_map", "gspmd" or "local").
      axis_name: the tensor-parallel axis.
      *arrays: the operands, as given to `resolve_mode` (in "gspmd" mode without
        `jax.set_mesh`, a concrete kernel's `NamedSharding` names the mesh).
    """
    if mode == "shard_map":
        return int(collective.axis_size(axis_name, "echo_jax.flax"))
    if mode == "gspmd":
        mesh = _mesh_with(axis_name, arrays)
        if mesh is None:
            raise ValueError(f"axis_size: mode 'gspmd' needs a mesh: call the model under "
                             f"`with jax.set_mesh(mesh):` (or pass the operands whose "
                             f"NamedSharding names it)")
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        return int(sizes.get(axis_name, 1))
    return 1


# --------------------------------------------------------------------------------------------
# the compensator state of one pass


def state_dtype(config: SiteConfigs):
    """The state dtype of a site config (tuple): the configs' `state_dtype` (fp32 for None).

    Raises:
      ValueError: configs of one tuple that disagree on it.
    """
    configs = tuple(config) if isinstance(config, (tuple, list)) else (config,)
    names = {c.state_dtype for c in configs if isinstance(c, EchoConfig)}
    if len(names) > 1:
        raise ValueError(f"the site configs disagree on EchoConfig.state_dtype ({sorted(names)}); "
                         "one state flows through them, so give them one")
    return jnp.dtype(names.pop() if names else "float32")


def zero_state(like, *, axis_name: str = "tp", config: SiteConfigs = None, mode: str = "auto",
               where: str = "reset") -> CompensatorState:
    """The zero compensator state at the start of a pass, for sites that reduce values like `like`.

    Args:
      like: the reduced value (an array or a ShapeDtypeStruct): the row site's output
        [..., out], the column site's input [..., in]; in "shard_map" mode this rank's value.
      axis_name: the tensor-parallel axis.
      config: the sites' config (or tuple): the state is made in its `state_dtype`.
      mode: as the layers' (resolved here the same way).
      where: the caller, for messages.

    Returns:
      CompensatorState(m1, m2) of zeros: per rank, `like`'s shape ("shard_map", "local"), or
      global [P, *like.shape] sharded over `axis_name` on the new dim ("gspmd",
      `echo_jax.gspmd.state_for`).
    """
    dt = state_dtype(config)
    resolved = resolve_mode(mode, axis_name, where=where)
    if dt in (jnp.int8, jnp.int4) and resolved == "gspmd":
        raise ValueError(
            f"{where}: EchoConfig.state_dtype={jnp.dtype(dt).name!r} runs in the layers' \"shard_map\" and "
            "\"local\" modes, not yet in \"gspmd\" mode (its per-group scales are not laid "
            "out for a state sharded by the jit / GSPMD helpers); run the model inside "
            "jax.shard_map, or give the layers state_dtype='float32' or 'bfloat16'")
    if resolved == "gspmd":
        return gspmd.state_for(like, axis=axis_name, dtype=dt)
    if resolved == "shard_map":
        return init_state(like, dtype=dt, axis_name=axis_name)
    return init_state(jax.ShapeDtypeStruct(jnp.shape(like), jnp.float32), dtype=dt)


def check_state(state, value, mode: str, axis_name: str, where: str, *arrays):
    """A ValueError unless `state` is a CompensatorState of the shape this site reduces.

    Args:
      state: the carrier's state for this site.
      value: the value the site reduces (an array or a ShapeDtypeStruct).
      mode: the resolved mode.
      axis_name: the tensor-parallel axis.
      where: the caller, for messages.
      *arrays: the operands given to `resolve_mode` (the kernel): in "gspmd" mode without
        `jax.set_mesh` a concrete kernel's `NamedSharding` names the mesh.
    """
    if not isinstance(state, CompensatorState):
        raise ValueError(f"{where}: the compensator state must be a CompensatorState, got "
                         f"{type(state).__name__}")
    want = tuple(jnp.shape(value))
    m1 = state.m1.codes if isinstance(state.m1, QuantizedMoment) else state.m1
    have = tuple(jnp.shape(m1))
    if mode == "gspmd":
        p = axis_size(mode, axis_name, *arrays)
        if have == want and p > 1 and jax.sharding.get_abstract_mesh().empty:
            raise ValueError(
                f"{where}: no mesh is set, so the carrier's reset(x) made a one-device state "
                f"shaped {have}, but this layer runs on the mesh of its kernel's NamedSharding "
                f"({axis_name!r} of size {p}), where its state is [P, *value.shape] = "
                f"{(p,) + want}. Call the model under `with jax.set_mesh(mesh):` with the mesh "
                "of its parameters, so that the carrier and the layers see one mesh (eager "
                "calls and jit steps alike)")
        want = (p,) + want
    if have != want:
        raise ValueError(
            f"{where}: the compensator state is shaped {have}, but this site reduces a value "
            f"shaped {tuple(jnp.shape(value))} (its state in {mode!r} mode: {want}). Reset the "
            "carrier at the start of every forward pass with a value shaped like the sites' "
            "(carrier.reset(x)): a new batch or sequence length (KV-cache decoding) makes a new "
            "state; all sites of one carrier reduce values of one shape (use a second carrier "
            "otherwise)")


# --------------------------------------------------------------------------------------------
# the two sites on a kernel


def _dot(x, kernel, precision):
    """Dense's contraction: x's last dim with the kernel's first (`lax.dot_general`)."""
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _add_bias(y, bias):
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def column_parallel(x, kernel, bias=None, *, axis_name: str = "tp", config: SiteConfigs = None,
                    choice=None, state: CompensatorState | None = None, rescale: bool = True,
                    precision=None, mode: str = "auto", where: str = "column_parallel"):
    """A column-parallel dense layer: y = f(x) @ kernel + bias (Megatron's f, Sec. 5.4).

    Args:
      x: [..., in], replicated over `axis_name` (already promoted to the compute dtype).
      kernel: "shard_map": this rank's [in, out/P]; "gspmd" / "local": the global [in, out].
      bias: None, or the bias of the kernel's columns ([out/P] per rank, or global [out]).
      axis_name: the tensor-parallel axis.
      config: an `EchoConfig`, None (exact `lax.psum`), or a tuple picked by `choice`.
      choice: an int index into a tuple `config` (may be traced).
      state: the backward `CompensatorState` (shaped like x; "gspmd": [P, *x.shape]) or None
        (a fresh zero state: the site runs uncompensated, Sec. 5.1 starts from zeros).
      rescale: the power-of-two rescaling of the cotangent (on by default, Sec. 5.4).
      precision: as `lax.dot_general`'s.
      mode: "auto", "shard_map" or "gspmd"; resolved by `resolve_mode`.
      where: the caller, for messages.

    Returns:
      (y, state): y [..., out/P] ("shard_map") or [..., out] sharded over `axis_name`
      ("gspmd"); the state unchanged in value (its cotangent carries the live backward state,
      as `echo_jax.tp.backward_site`'s).
    """
    resolved = resolve_mode(mode, axis_name, kernel, where=where)
    if state is not None:
        check_state(state, x, resolved, axis_name, where, kernel)
    if resolved == "local":
        return _add_bias(_dot(x, kernel, precision), bias), state
    if resolved == "gspmd":
        if state is None:
            y = gspmd.column_parallel_matmul(x, kernel, axis=axis_name, config=config,
                                             choice=choice, rescale=rescale, precision=precision)
        else:
            y, state = gspmd.column_parallel_matmul(x, kernel, axis=axis_name, config=config,
                                                    state=state, choice=choice, rescale=rescale,
                                                    precision=precision)
        return _add_bias(y, bias), state
    site_state = init_state(x, dtype=state_dtype(config), axis_name=axis_name) \
        if state is None else state
    xin, site_state = tp.backward_site(x, axis_name, config, site_state, choice=choice,
                                       rescale=rescale)
    y = _add_bias(_dot(xin, kernel, precision), bias)
    return y, (None if state is None else site_state)


def row_parallel(x, kernel, bias=None, *, axis_name: str = "tp", config: SiteConfigs = None,
                 choice=None, state: CompensatorState | None = None, rescale: bool = False,
                 precision=None, mode: str = "auto", where: str = "row_parallel"):
    """A row-parallel dense layer: y = g(x @ kernel) + bias (Megatron's g, Sec. 5.4).

    Args:
      x: [..., in] with `in` split over `axis_name` ("shard_map": this rank's [..., in/P]).
      kernel: "shard_map": this rank's [in/P, out]; "gspmd" / "local": the global [in, out].
      bias: None, or [out] (replicated), added once after the reduction.
      axis_name, config, choice, precision, mode, where: as `column_parallel`'s.
      state: the forward `CompensatorState` (shaped like y; "gspmd": [P, *y.shape]) or None
        (uncompensated).
      rescale: the power-of-two rescaling around the all-reduce (off in the forward pass, as the
        paper's).

    Returns:
      (y, state): y [..., out], the reduced sum (replicated over `axis_name`); the new state.
    """
    resolved = resolve_mode(mode, axis_name, kernel, where=where)
    out = jax.ShapeDtypeStruct(jnp.shape(x)[:-1] + (jnp.shape(kernel)[-1],), x.dtype)
    if resolved == "local":
        if state is not None:
            check_state(state, out, resolved, axis_name, where)
        return _add_bias(_dot(x, kernel, precision), bias), state
    if resolved == "gspmd":
        if state is not None:
            check_state(state, out, resolved, axis_name, where, kernel)
            y, state = gspmd.row_parallel_matmul(x, kernel, axis=axis_name, config=config,
                                                 state=state, choice=choice, rescale=rescale,
                                                 precision=precision)
        else:
            y = gspmd.row_parallel_matmul(x, kernel, axis=axis_name, config=config,
                                          choice=choice, rescale=rescale, precision=precision)
        return _add_bias(y, bias), state
    part = _dot(x, kernel, precision)
    if state is not None:
        check_state(state, part, resolved, axis_name, where)
    y, state = tp.forward_site(part, axis_name, config, state, choice=choice, rescale=rescale)
    return _add_bias(y, bias), state


#: A layer's site per kind: the site function and the carrier's state it threads.
_SITES = {"column": (column_parallel, "bwd"), "row": (row_parallel, "fwd")}


def site_with_carrier(kind: str, x, kernel, bias=None, *, echo=None, axis_name: str = "tp",
                      config: SiteConfigs = None, choice=None, rescale: bool = False,
                      precision=None, mode: str = "auto", where: str = "site_with_carrier"):
    """A layer's site on the state of its carrier: `column_parallel` ("column", on the backward
    state "bwd") or `row_parallel` ("row", on the forward state "fwd"), the new state stored
    back in the carrier for the next site of that direction.

    Args:
      kind: "column" or "row".
      x, kernel, bias, axis_name, config, choice, rescale, precision, mode, where: as the
        site's (`column_parallel` / `row_parallel`); x, kernel and bias already promoted.
      echo: the layer's carrier (a Linen or NNX `EchoCarrier`: `get(direction)` and
        `put(direction, state)`), or None (the site runs uncompensated).

    Returns:
      y, the site's output.
    """
    site, direction = _SITES[kind]
    state = None if echo is None else echo.get(direction)
    y, state = site(x, kernel, bias, axis_name=axis_name, config=config, choice=choice,
                    state=state, rescale=rescale, precision=precision, mode=mode, where=where)
    if echo is not None:
        echo.put(direction, state)
    return y


# --------------------------------------------------------------------------------------------
# parameters


def sharded_init(init, global_shape, dim: int, axis_name: str):
    """An initializer of this rank's block of a parameter split over `axis_name` on `dim`.

    It initializes the global parameter with `init` and the same key on every rank, then keeps
    this rank's slice (`lax.axis_index`), so a model initialized per rank inside `jax.shard_map`
    holds the same global parameters as the unsharded model initialized with the same key (at
    the cost of each rank making the whole parameter once, at init).

    Args:
      init: a Flax / JAX initializer `init(key, shape, dtype)`.
      global_shape: the unsharded parameter's shape.
      dim: the dim split over `axis_name`.
      axis_name: the bound tensor-parallel axis.

    Returns:
      An initializer `f(key, shape, dtype)` with shape the local block's.
    """
    def f(key, shape, dtype=jnp.float32):
        full = init(key, tuple(global_shape), dtype)
        n = shape[dim]
        return lax.dynamic_slice_in_dim(full, lax.axis_index(axis_name) * n, n, axis=dim)
    return f


def split_features(n: int, p: int, what: str, where: str) -> int:
    """n / p, or a ValueError naming the layer and the sizes."""
    if n % p:
        raise ValueError(f"{where}: {what} ({n}) must be divisible by the size of the "
                         f"tensor-parallel axis ({p})")
    return n // p


__all__ = ["MODES", "axis_bound", "resolve_mode", "axis_size", "state_dtype",
           "zero_state", "check_state", "column_parallel", "row_parallel", "site_with_carrier",
           "sharded_init", "split_features"]
