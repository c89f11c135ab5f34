"""Megatron's two tensor-parallel dense layers, one definition for Linen and NNX.

The Echo paper (arXiv 2610.14277) Sec. 5.4 puts Echo at Megatron's two sites:

* column-parallel (`COLUMN`): the kernel [in, out] split over the tensor-parallel axis on `out`
  (its bias likewise); the input x, replicated over the axis, enters through the backward site f
  (identity forward; the Echo all-reduce of its cotangent backward, with the power-of-two
  rescaling on by default); the output is this rank's `out / P` features;
* row-parallel (`ROW`): the kernel split on `in`, the input split likewise (e.g. a
  column-parallel layer's output); the local contraction, then the forward site g (the Echo
  all-reduce of the partial sums forward, rescaling off by default; identity backward), then the
  bias (replicated), added once.

A `ParallelKind` says how a layer of one kind splits its parameters and which site it runs; the
Linen layers (`echo_jax.flax.linen`) and the NNX ones (`echo_jax.flax.nnx`) make their parameters
from it and call `apply_site`, so the two frameworks differ only in how parameters and the
carrier's state are stored.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from flax.linen.dtypes import promote_dtype

import jax.numpy as jnp

from echo_jax import tp
from echo_jax.flax.sites import (MODES, SiteConfigs, axis_size, resolve_mode, site_with_carrier,
                                 split_features)


@dataclasses.dataclass(frozen=True)
class ParallelKind:
    """How one of Megatron's parallel layers splits its parameters and which site it runs.

    Attributes:
      site: "column" or "row" (the site of `echo_jax.flax.site_with_carrier`).
      kernel_split_dim: the kernel dim split over the axis (1: out, column; 0: in, row).
      split_bias: whether the bias is split over the axis with the kernel's columns (column) or
        replicated (row).
      split_input: whether the input's last dim is split over the axis (row) or replicated
        (column).
      rescale: the default of the layer's `rescale` (the power-of-two rescaling around the
        all-reduce: on for the cotangent of f, off for the forward g, as the paper's).
    """

    site: str
    kernel_split_dim: int
    split_bias: bool
    split_input: bool
    rescale: bool

    def kernel_sharding(self, axis_name: str) -> tuple:
        """The logical sharding of the global kernel [in, out]: `(None, axis)` or `(axis, None)`."""
        return tuple(axis_name if d == self.kernel_split_dim else None for d in range(2))

    def bias_sharding(self, axis_name: str) -> tuple:
        """The logical sharding of the bias [out]: `(axis,)` (column) or `(None,)` (row)."""
        return (axis_name if self.split_bias else None,)

    def bias_split_dim(self) -> Optional[int]:
        """The bias dim split over the axis (0), or None where the bias is replicated."""
        return 0 if self.split_bias else None

    def global_in_features(self, local_in: int, p: int) -> int:
        """The layer's `in` from the last dim of this rank's input (P, the axis size)."""
        return local_in * p if self.split_input else local_in


#: The column-parallel layer (Megatron's f before the matmul).
COLUMN = ParallelKind(site="column", kernel_split_dim=1, split_bias=True, split_input=False,
                      rescale=True)
#: The row-parallel layer (Megatron's g after the matmul).
ROW = ParallelKind(site="row", kernel_split_dim=0, split_bias=False, split_input=True,
                   rescale=False)


def block_shape(global_shape, dim: Optional[int], p: int, what: str, where: str) -> tuple:
    """This rank's block of a parameter split over the axis on `dim` (the whole shape for None).

    Args:
      global_shape: the unsharded parameter's shape.
      dim: the split dim, or None (replicated).
      p: the size of the tensor-parallel axis.
      what: the layer argument that sets that dim's size, for messages.
      where: the layer, for messages.

    Returns:
      The shape with `dim` divided by P.

    Raises:
      ValueError: a size that P does not divide.
    """
    shape = tuple(global_shape)
    if dim is None:
        return shape
    return shape[:dim] + (split_features(shape[dim], p, what, where),) + shape[dim + 1:]


def check_layer(where: str, *, mode: str, config: SiteConfigs, echo, carrier_type) -> None:
    """Checks a layer's Echo arguments, so a wrong one fails with the layer's name.

    Args:
      where: the layer, for messages.
      mode: "auto", "shard_map" or "gspmd".
      config: an `EchoConfig`, None, or a tuple of them.
      echo: the layer's carrier, or None.
      carrier_type: the framework's `EchoCarrier` class.

    Raises:
      ValueError: an unknown mode, a config that is not an `EchoConfig` or None, a carrier of
        another type.
    """
    if mode not in MODES:
        raise ValueError(f"{where}: mode must be one of {MODES}, got {mode!r}")
    tp.check_site_configs(config, where)
    if echo is not None and not isinstance(echo, carrier_type):
        raise ValueError(f"{where}: echo must be an EchoCarrier or None, got "
                         f"{type(echo).__name__}")


def apply_site(kind: ParallelKind, inputs, kernel, bias=None, *, dtype=None, echo=None,
               axis_name: str = "tp", config: SiteConfigs = None, choice=None,
               rescale: bool = False, precision=None, mode: str = "auto",
               where: str = "apply_site"):
    """A layer's forward: the operands promoted to one dtype (as `flax.linen.Dense` /
    `nnx.Linear` do), then its site, the state threaded through the carrier `echo`
    (`echo_jax.flax.site_with_carrier`).

    Args:
      kind: `COLUMN` or `ROW`.
      inputs: [..., in] (column: replicated over the axis; row: split over it on the last dim).
      kernel: this rank's block ("shard_map") or the global kernel [in, out].
      bias: the bias (this rank's block or global), or None.
      dtype: the computation dtype (None: the operands' promoted dtype).
      echo: the layer's carrier, or None (uncompensated).
      axis_name, config, choice, rescale, precision, mode, where: as
        `echo_jax.flax.column_parallel`'s / `row_parallel`'s.

    Returns:
      The layer's output: column [..., out / P] ("shard_map") or [..., out] sharded over the
      axis ("gspmd"); row [..., out], replicated over the axis.
    """
    inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=dtype)
    return site_with_carrier(kind.site, inputs, kernel, bias, echo=echo, axis_name=axis_name,
                             config=config, choice=choice, rescale=rescale,
                             precision=precision, mode=mode, where=where)


def fuse_columns(blocks, p: int):
    """The column-parallel parameters of several outputs as one, rank by rank.

    Each block [..., f_i] is split over the axis on its last dim (rank r holds features
    [r f_i / P, (r + 1) f_i / P) of each). The fused array puts rank r's slices side by side
    (Megatron's fused QKV layout): [..., P, f_1/P + f_2/P + ...] flattened to
    [..., sum f_i], so that its block r over the axis is [q_r, k_r, v_r].

    Args:
      blocks: the arrays [..., f_i] (global, or this rank's blocks with `p` = 1), or Nones.
      p: the number of ranks the last dim is split over in these arrays (1 for per-rank blocks).

    Returns:
      The fused array, or None where every block is None.
    """
    if all(b is None for b in blocks):
        return None
    parts = [jnp.reshape(b, b.shape[:-1] + (p, b.shape[-1] // p)) for b in blocks]
    fused = jnp.concatenate(parts, axis=-1)
    return jnp.reshape(fused, fused.shape[:-2] + (-1,))


def split_columns(y, sizes, p: int) -> tuple:
    """`fuse_columns` undone on a fused output: [..., sum f_i] -> a tuple of [..., f_i].

    Args:
      y: the fused output (global with the rank-by-rank layout, or this rank's with `p` = 1).
      sizes: the outputs' sizes f_i in `y`'s terms (global, or this rank's f_i / P with p = 1).
      p: as `fuse_columns`'.
    """
    y = jnp.reshape(y, y.shape[:-1] + (p, -1))
    out, start = [], 0
    for f in sizes:
        n = f // p
        part = y[..., start:start + n]
        out.append(jnp.reshape(part, part.shape[:-2] + (f,)))
        start += n
    return tuple(out)


def apply_fused_column(inputs, kernels, biases, *, dtype=None, echo=None,
                       axis_name: str = "tp", config: SiteConfigs = None, choice=None,
                       rescale: bool = True, precision=None, mode: str = "auto",
                       where: str = "apply_fused_column"):
    """A fused column-parallel layer's forward: one site f on the shared input, several outputs.

    The kernels [in, f_i] (and biases [f_i]) are fused rank by rank (`fuse_columns`), so the
    layer runs one column-parallel site: one backward Echo all-reduce of the input's cotangent,
    where separate layers would run one each (as Megatron's fused QKV and gate / up
    projections). The output is split back per kernel.

    Args:
      inputs: [..., in], replicated over the axis.
      kernels: the kernels, this rank's blocks [in, f_i / P] ("shard_map") or the global
        [in, f_i].
      biases: the biases (blocks or global), or Nones.
      dtype, echo, axis_name, config, choice, rescale, precision, mode, where: as
        `apply_site`'s.

    Returns:
      A tuple of outputs, one per kernel: [..., f_i / P] ("shard_map") or [..., f_i] sharded
      over the axis ("gspmd").
    """
    inputs, *params = promote_dtype(inputs, *kernels, *biases, dtype=dtype)
    kernels, biases = params[:len(kernels)], params[len(kernels):]
    resolved = resolve_mode(mode, axis_name, *kernels, where=where)
    p = axis_size(resolved, axis_name, *kernels) if resolved == "gspmd" else 1
    sizes = [k.shape[-1] for k in kernels]
    for f in sizes:
        split_features(f, p, "each output's features", where)
    y = site_with_carrier("column", inputs, fuse_columns(kernels, p), fuse_columns(biases, p),
                          echo=echo, axis_name=axis_name, config=config, choice=choice,
                          rescale=rescale, precision=precision, mode=mode, where=where)
    return split_columns(y, sizes, p)


__all__ = ["ParallelKind", "COLUMN", "ROW", "block_shape", "check_layer", "apply_site",
           "fuse_columns", "split_columns", "apply_fused_column"]
