"""The check that `echo_psum` runs inside a shard_map that is manual over every mesh axis.

In a jit program whose arrays carry `NamedSharding`s, a user may wrap one matrix multiplication in
a *partial-manual* `jax.shard_map(..., axis_names={"tp"})` and call `echo_psum` over "tp" in it.
The numbers are right, but the other mesh axes of size > 1 (a "dp" or "fsdp" batch axis) stay
automatic inside it: the contribution is not manual over them, so XLA all-gathers it across them
where the quantized exchange needs it per device (every device then quantizes and exchanges the
whole batch, more bytes than the `lax.psum` it replaced), and the custom call cannot run (XLA
would replicate it over those axes), so transport "auto" runs "xla". `check` says so with an
`EchoShardingWarning` (a warning, not an error: the result is right, only its cost is wrong).

The fix is a shard_map manual over every mesh axis the operands are sharded on: the helpers of
`echo_jax.gspmd` (`row_parallel_matmul`, `column_parallel_matmul`) build it.

This module sits below `echo_jax.collective` (which calls `check` at the top of `echo_psum`)
and imports nothing of echo_jax, so that the import graph stays a tree.
"""

from __future__ import annotations

import warnings

import jax


class EchoShardingWarning(UserWarning):
    """Echo runs, but the sharding of the program makes it cost more than it should (or not at
    all: a helper of `echo_jax.gspmd` fell back to the plain contraction); the message says why
    and what to change."""


def _axes(axis_name) -> tuple:
    if isinstance(axis_name, (tuple, list)):
        return tuple(axis_name)
    return (axis_name,)


def auto_axes_beside(axis_name) -> tuple:
    """The mesh axes of size > 1 that are not manual in the shard_map enclosing this trace,
    where that shard_map is manual over `axis_name` (one name or a tuple of names).

    Empty outside a shard_map (under `jax.vmap`, plain jit), where `axis_name` is not a manual
    axis of it (e.g. a vmap axis inside shard_map), and in a shard_map manual over every mesh
    axis of size > 1: the cases where nothing is gathered behind the all-reduce's back.

    Returns:
      (name, size) pairs in mesh order.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    axes = _axes(axis_name)
    if not manual or not all(a in manual for a in axes):
        return ()
    return tuple((name, int(size)) for name, size in zip(mesh.axis_names, mesh.axis_sizes)
                 if name not in manual and size > 1)


def check(x, axis_name, where: str = "echo_psum") -> None:
    """Warns (`EchoShardingWarning`) when an all-reduce over `axis_name` runs in a shard_map that
    leaves mesh axes of size > 1 automatic (`auto_axes_beside`).

    Args:
      x: the contribution (an array or a pytree; only its type is read, for the message).
      axis_name: the reduced axis (a name or a tuple of names).
      where: the public function that asks, for the message.
    """
    others = auto_axes_beside(axis_name)
    if not others:
        return
    leaves = jax.tree.leaves(x)
    seen = ""
    if leaves:
        try:
            seen = f" (the contribution is typed {jax.typeof(leaves[0])})"
        except TypeError:  # a Python scalar
            seen = ""
    names = [name for name, _ in others]
    sizes = ", ".join(f"{name!r} of size {size}" for name, size in others)
    warnings.warn(
        f"{where} over {axis_name!r} runs in a shard_map that is not manual over the mesh axes "
        f"{sizes}{seen}: XLA gathers the contribution across {names} before the exchange, so "
        "every device quantizes and exchanges the whole batch (more bytes than the lax.psum it "
        "replaces), and the Echo custom call cannot run there (transport 'auto' runs 'xla'). "
        f"Make the shard_map manual over every mesh axis of size > 1 (leave out axis_names, or "
        f"add {names}), or use echo_jax.gspmd.row_parallel_matmul / column_parallel_matmul, "
        "which do.", EchoShardingWarning, stacklevel=3)


__all__ = ["EchoShardingWarning", "auto_axes_beside", "check"]
