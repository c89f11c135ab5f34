"""The one place where echo_jax meets JAX APIs that differ between the JAX versions it supports.

Tested with jax / jaxlib 0.11.2 (constraints.txt, the GPU machine) and 0.12.0.1
(constraints-latest.txt); pyproject.toml accepts that range. Everything else in the package uses
these helpers instead of reaching into `jax._src` or a version's attribute names, so a new JAX
release needs changes here only. Both versions need the same code today: there are no version
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

The one private API left: the concrete mesh of `jax.set_mesh` while tracing (the CUDA custom
call needs the device ids of each group), `jax._src.mesh.get_concrete_mesh` in both versions;
the public `jax.sharding.get_mesh` refuses to run under `jax.jit`.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which x is typed as varying (empty outside a typed shard_map)."""
    mat = getattr(jax.typeof(x), "mat", None)  # JAX 0.11 / 0.12: ShapedArray.mat.varying
    return frozenset(mat.varying) if mat is not None else frozenset()


def varies_over(x, axis) -> bool:
    """Whether x is typed as varying over a shard_map axis (never true for a vmap axis)."""
    return axis in varying_axes(x)


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
    `lax.psum`'s result is) when x is typed as varying over it; otherwise `lax.all_gather`."""
    if varies_over(x, axis):
        return lax.all_gather(x, axis, to="invarying")
    return lax.all_gather(x, axis)


def concrete_mesh():
    """The concrete `Mesh` set by `jax.set_mesh` (an empty one when none is set); works under jit."""
    from jax._src import mesh as mesh_lib
    return mesh_lib.get_concrete_mesh()


__all__ = ["varying_axes", "varies_over", "manual_axes", "to_varying", "all_gather_invariant",
           "concrete_mesh"]
