"""The one place where echo_jax meets JAX APIs that differ between the JAX versions it supports.

Tested with jax / jaxlib 0.11.2 (constraints.txt, the versions of the GPU measurements) and
0.12.0.1 (constraints-latest.txt); pyproject.toml accepts that range. Everything else in the
package uses these helpers instead of reaching into `jax._src` or a version's attribute names, so
a new JAX release needs changes here only. Both versions need the same code today: there are no version
checks, only the APIs that work in both.

Varying-manual-axes typing (`jax.shard_map` with its default `check_vma=True`): every value
inside a shard_map has a type that says over which manual mesh axes it may differ between
ranks ("varying") and over which it is the same everywhere ("invariant"). `lax.psum` returns an
invariant value; a scan carry, a `lax.switch` branch and a `custom_vjp` cotangent must keep one
type. The helpers below read and set that type the JAX way (`jax.typeof(x)`, `lax.pcast`):

* JAX 0.11 and 0.12 both keep the varying axes in `jax.typeof(x).mat.varying` (a
  `ManualAxisType`); `varying_axes` is the only reader of that field.
* The invariant all-gather (the gather half of Echo's all-reduce, typed like `lax.psum`'s
  result) is public in both as `lax.all_gather(x, axis, to="invarying")`; 0.12 removed the
  private `jax._src.lax.parallel.all_gather_invariant` that echo_jax imported before.

Under `jax.vmap(..., axis_name=...)` or `shard_map(..., check_vma=False)` nothing is typed:
`varying_axes` is empty and the casts are no-ops.

The private APIs left: `weakly_typed` (JAX has no public way to make a result weakly typed, as
`lax.psum` keeps a Python scalar's weak type), and the concrete mesh of `jax.set_mesh` while
tracing (the CUDA custom call needs the device ids of each group),
`jax._src.mesh.get_concrete_mesh` in both versions; the public `jax.sharding.get_mesh` refuses
to run under `jax.jit`.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which x is typed as varying (empty outside a typed shard_map)."""
    mat = getattr(jax.typeof(x), "mat", None)  # JAX 0.11 / 0.12: ShapedArray.mat.varying
    return frozenset(mat.varying) if mat is not None else frozenset()


def axis_names(axis_name) -> tuple:
    """`axis_name` as `lax.psum` takes it (one name, or a tuple / list of names) as a tuple."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def varies_over(x, axis) -> bool:
    """Whether x is typed as varying over a shard_map axis, or over every axis of a tuple of
    them (never true for a vmap axis)."""
    have = varying_axes(x)
    if isinstance(axis, (tuple, list)):
        return bool(axis) and all(a in have for a in axis)
    return axis in have


def unreduced_axes(x) -> frozenset:
    """The mesh axes over which x is typed unreduced (`{U:...}`: each rank holds a partial sum
    whose true value is their sum); empty outside a typed shard_map / explicit sharding."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "unreduced", ()) or ()) if mat is not None else frozenset()


def reduced_axes(x) -> frozenset:
    """The mesh axes over which x is typed reduced (`{R:...}`); empty where nothing is typed."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "reduced", ()) or ()) if mat is not None else frozenset()


def manual_axes() -> frozenset:
    """The manual axes of the enclosing shard_map (empty outside one, e.g. under vmap)."""
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def to_varying(x, axes):
    """Types x as varying over `axes` (one axis name or several), like `lax.pcast(x, axes,
    to="varying")`, but only over those that are manual axes of the enclosing shard_map and x
    does not vary over yet. A no-op under vmap axes and in `shard_map(check_vma=False)`, where
    there are no types to cast. It changes the type only, never a value.
    """
    axes = tuple(axes) if isinstance(axes, (tuple, list, set, frozenset)) else (axes,)
    manual, have = manual_axes(), varying_axes(x)
    mesh_order = jax.sharding.get_abstract_mesh().axis_names
    missing = tuple(a for a in mesh_order if a in axes and a in manual and a not in have)
    if not missing:
        return x
    try:
        return lax.pcast(x, missing, to="varying")
    except (ValueError, AssertionError, TypeError):  # shard_map(check_vma=False)
        return x


def all_gather_invariant(x, axis):
    """All-gather of x over `axis` (a new leading axis), typed as invariant over `axis` (as
    `lax.psum`'s result is) when x is typed as varying over it; otherwise `lax.all_gather`.

    `axis` may be a tuple of axis names: the leading axis then runs over their product group in
    `lax.axis_index(axis)` order (the first name major). Where not every name is a manual axis
    (e.g. nested `jax.vmap`s, whose all_gather over a tuple of names fails), it is one gather
    per name, the last name first, which gives that order.
    """
    if isinstance(axis, (tuple, list)):
        names = tuple(axis)
        if len(names) == 1:
            return all_gather_invariant(x, names[0])
        manual = manual_axes()
        if all(a in manual for a in names):
            if varies_over(x, names):
                return lax.all_gather(x, names, to="invarying")
            return lax.all_gather(x, names)
        out = x
        for name in reversed(names):
            out = all_gather_invariant(out, name)
        return out.reshape((-1,) + tuple(x.shape))
    if varies_over(x, axis):
        return lax.all_gather(x, axis, to="invarying")
    return lax.all_gather(x, axis)


def weakly_typed(x):
    """x typed as a weak-typed array of its dtype (as a Python scalar is, `lax.psum(1.0, ...)`'s
    result too); the values are unchanged. JAX has no public API for it: this uses the private
    `_convert_element_type(..., weak_type=True)` of `jax._src.lax.lax` (0.11 and 0.12), and
    returns x as it is where that is missing."""
    try:
        from jax._src.lax import lax as lax_internal
        return lax_internal._convert_element_type(x, x.dtype, weak_type=True)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a future JAX
        return x


def concrete_mesh():
    """The concrete `Mesh` set by `jax.set_mesh` (an empty one when none is set); works under jit."""
    from jax._src import mesh as mesh_lib
    return mesh_lib.get_concrete_mesh()


__all__ = ["axis_names", "varying_axes", "varies_over", "unreduced_axes", "reduced_axes",
           "manual_axes", "to_varying", "all_gather_invariant", "weakly_typed", "concrete_mesh"]
