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

from echo_jax import tp
from echo_jax.flax.sites import MODES, SiteConfigs, site_with_carrier, split_features


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


__all__ = ["ParallelKind", "COLUMN", "ROW", "block_shape", "check_layer", "apply_site"]
