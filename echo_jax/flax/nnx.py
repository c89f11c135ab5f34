"""Flax NNX layers with Echo: `ColumnParallelLinear`, `RowParallelLinear`, `EchoCarrier`.

Drop-in replacements of `flax.nnx.Linear` for Megatron's tensor-parallel MLP / attention (the
Echo paper, arXiv 2610.14277, Sec. 5.4): a column-parallel layer (the kernel's output features
split over `axis_name`; its input's cotangent all-reduced by Echo in the backward pass, site f)
followed by a row-parallel one (the kernel's input features split; the partial sums all-reduced
by Echo in the forward pass, site g; the bias added once, after the reduction).

    class MLP(nnx.Module):
        def __init__(self, config, *, rngs):
            self.echo = EchoCarrier(config)                 # the compensator state's carrier
            self.fc1 = ColumnParallelLinear(64, 256, config=config, echo=self.echo, rngs=rngs)
            self.fc2 = RowParallelLinear(256, 64, config=config, echo=self.echo, rngs=rngs)

        def __call__(self, x):
            self.echo.reset(x)                              # zeros at the start of every pass
            return self.fc2(nnx.gelu(self.fc1(x)))

The parameters are `nnx.Param`s of the global shapes (as `nnx.Linear`'s, created from the same
`rngs` stream in the same order, so the same seed gives the same values) with the sharding
metadata `out_sharding` (column kernel `(None, axis_name)`, its bias `(axis_name,)`; row kernel
`(axis_name, None)`, its bias replicated): under `jax.set_mesh(mesh)` NNX shards them as they
are created, and `nnx.get_partition_spec(nnx.state(model))` gives shard_map's specs. Outside a
mesh the metadata is kept and nothing is sharded (one device).

Where the layers run (`mode`, see `echo_jax.flax`): in a `jax.jit` / `nnx.jit` program under
`jax.set_mesh(mesh)` ("gspmd": the kernels are the global arrays) or per rank inside
`jax.shard_map` over `axis_name` ("shard_map": `nnx.split` the model, pass the state with the
specs, `nnx.merge` inside; the kernels are this rank's blocks); "auto" tells them apart by
whether `axis_name` is bound.

The compensator state (Algorithm 1, Sec. 5.1) is two `EchoState` variables (an `nnx.Variable`
subclass holding a `CompensatorState`) of an `EchoCarrier` shared by the model's layers: "fwd",
read and written by every row-parallel layer in call order, and "bwd", threaded the same way
through the column-parallel layers (its cotangent carries the live backward state in the backward
pass, as `echo_jax.tp.backward_site`). `reset(x)` at the start of every forward pass assigns
zeros shaped like x (`Variable.set_value`, which takes a new shape: a new batch size or a
KV-cache decoding step makes a new state; `v[...] = ` would write into the old shape). Through
`nnx.scan` over stacked layers, carry the carrier (`in_axes=(nnx.Carry, 0)` with
`(x, carrier)` as the carry) and pass it at call time (`layer(x, echo=carrier)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init

from echo_jax import flax as core
from echo_jax import tp
from echo_jax.compensator import CompensatorState


class EchoState(nnx.Variable):
    """An Echo compensator state (a `CompensatorState` (m1, m2), or None before the first pass).

    A Variable type of its own, so that filters select it: `nnx.state(model, EchoState)`, or
    `nnx.split(model, nnx.Param, EchoState)`; optimizers (`wrt=nnx.Param`) and `nnx.grad` leave
    it alone.
    """


class EchoCarrier(nnx.Module):
    """The compensator state of a model's Echo sites: two `EchoState` variables.

    One carrier per model (or per group of sites that reduce values of one shape), shared by its
    layers (their `echo=` argument, at construction or per call). "fwd" is the forward state of
    the row-parallel sites and "bwd" the backward state of the column-parallel sites, each read
    and written by the sites in call order (the Echo paper Sec. 5.1 and 5.4).

    Args:
      config: the sites' `EchoConfig` (or tuple of them, or None): the state is made in its
        `state_dtype`.
      axis_name: the tensor-parallel axis.
      mode: "auto", "shard_map" or "gspmd", as the layers' (it decides whether the state is per
        rank or global [P, ...]).
    """

    def __init__(self, config: Any = None, *, axis_name: str = "tp", mode: str = "auto"):
        core.state_dtype(config)  # checks the configs agree on it
        self.config = config
        self.axis_name = axis_name
        self.mode = mode
        self.fwd = EchoState(None)
        self.bwd = EchoState(None)

    def reset(self, like, bwd_like=None) -> None:
        """Zeros for both states; call it at the start of every forward pass.

        Args:
          like: a value shaped like the row-parallel sites' outputs (e.g. the residual stream
            [B, T, D], this rank's in "shard_map" mode); an array or a ShapeDtypeStruct.
          bwd_like: a value shaped like the column-parallel sites' inputs (default: `like`).
        """
        kw = dict(axis_name=self.axis_name, config=self.config, mode=self.mode,
                  where="EchoCarrier.reset")
        self.fwd.set_value(core.zero_state(like, **kw))
        self.bwd.set_value(core.zero_state(like if bwd_like is None else bwd_like, **kw))

    def get(self, kind: str) -> CompensatorState:
        """The current state of one direction ("fwd" or "bwd")."""
        if kind not in ("fwd", "bwd"):
            raise ValueError(f"EchoCarrier.get: kind must be 'fwd' or 'bwd', got {kind!r}")
        state = getattr(self, kind).get_value()
        if state is None:
            raise ValueError("EchoCarrier: no compensator state: call carrier.reset(x) at the "
                             "start of the forward pass")
        if isinstance(state, Mapping):  # e.g. restored from a checkpoint as a dict
            return CompensatorState(state["m1"], state["m2"])
        return CompensatorState(*state)

    def put(self, kind: str, state: CompensatorState) -> None:
        """Stores the state a site returned (the next site of that direction reads it)."""
        getattr(self, kind).set_value(state)


def _param(value, names):
    """An `nnx.Param` with the sharding metadata `names`; sharded as created where a mesh is
    set (NNX's eager sharding), kept as metadata only where none is."""
    if jax.sharding.get_abstract_mesh().empty:
        return nnx.Param(value, out_sharding=names, eager_sharding=False)
    return nnx.Param(value, out_sharding=names)


class _ParallelLinear(nnx.Module):
    """What the two layers share (arguments as `flax.nnx.Linear`'s, plus Echo's)."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
                 param_dtype, precision, kernel_init, bias_init, axis_name: str, config,
                 mode: str, echo: Optional[EchoCarrier], rescale: bool, kernel_names,
                 bias_names, rngs: nnx.Rngs):
        where = type(self).__name__
        if mode not in core.MODES:
            raise ValueError(f"{where}: mode must be one of {core.MODES}, got {mode!r}")
        tp.check_site_configs(config, where)
        if echo is not None and not isinstance(echo, EchoCarrier):
            raise ValueError(f"{where}: echo must be an EchoCarrier or None, got "
                             f"{type(echo).__name__}")
        kernel_key = rngs.params()
        self.kernel = _param(kernel_init(kernel_key, (in_features, out_features), param_dtype),
                             kernel_names)
        if use_bias:
            bias_key = rngs.params()
            self.bias = _param(bias_init(bias_key, (out_features,), param_dtype), bias_names)
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.axis_name = axis_name
        self.config = config
        self.mode = mode
        self.echo = echo
        self.rescale = rescale

    def _site(self, kind, inputs, choice, echo, where):
        """The layer's site ("column" or "row"): the operands promoted, the kernel checked to be
        this rank's block in shard_map mode, the state threaded through the carrier (`echo`, else
        the one given at construction; `echo_jax.flax.site_with_carrier`)."""
        inputs, kernel, bias, echo = self._operands(inputs, echo)
        if kind == "column":
            self._check_block(kernel, 1, "out_features")
        else:
            self._check_block(kernel, 0, "in_features")
        return core.site_with_carrier(kind, inputs, kernel, bias, echo=echo,
                                      axis_name=self.axis_name, config=self.config, choice=choice,
                                      rescale=self.rescale, precision=self.precision,
                                      mode=self.mode, where=where)

    def _operands(self, inputs, echo):
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = nnx_dtypes.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        echo = self.echo if echo is None else echo
        if echo is not None and not isinstance(echo, EchoCarrier):
            raise ValueError(f"{type(self).__name__}: echo must be an EchoCarrier, got "
                             f"{type(echo).__name__}")
        return inputs, kernel, bias, echo

    def _check_block(self, kernel, dim, what):
        """In shard_map mode the kernel must be this rank's block: a clear error otherwise."""
        if not core.axis_bound(self.axis_name):
            return
        p = core.axis_size("shard_map", self.axis_name)
        want = (self.in_features, self.out_features)
        want = want[:dim] + (want[dim] // p,) + want[dim + 1:]
        if tuple(kernel.shape) != want:
            raise ValueError(
                f"{type(self).__name__}: inside a shard_map over {self.axis_name!r} (P = {p}) the "
                f"kernel must be this rank's block {want} ({what} split over the axis), got "
                f"{tuple(kernel.shape)}: pass the model's state into shard_map with the specs "
                "of nnx.get_partition_spec(state)")


class ColumnParallelLinear(_ParallelLinear):
    """A column-parallel `nnx.Linear`: y = f(x) @ kernel + bias, output features split over the
    tensor-parallel axis.

    Megatron's first layer of a block (the Echo paper Sec. 5.4): the input x is replicated over
    `axis_name`; each rank multiplies it by its `out_features / P` columns of the kernel (no
    communication forward); in the backward pass the partial cotangents of x are all-reduced by
    Echo (site f, `echo_jax.tp.backward_site`), with the power-of-two rescaling (`rescale`).

    Args:
      in_features: the number of input features.
      out_features: the number of output features of the whole (unsharded) layer.
      use_bias: whether to add a bias (split over the axis like the kernel's columns).
      dtype: the computation dtype (default: inferred from the input and params, as Linear).
      param_dtype: the dtype of the parameters (default float32).
      precision: `lax.Precision` of the contraction.
      kernel_init, bias_init: initializers of the global kernel [in, out] and bias [out] (any
        Flax / JAX initializer; the layer adds the sharding metadata).
      axis_name: the tensor-parallel mesh axis.
      config: an `EchoConfig`, None (the exact `lax.psum`), or a tuple of them picked per call by
        `choice` (e.g. `echo_jax.tp.early_8bit_configs(cfg)`).
      mode: "auto", "shard_map" or "gspmd" (see `echo_jax.flax`).
      echo: the model's `EchoCarrier` (the backward state "bwd" flows through it), or None
        (uncompensated, unless one is passed per call).
      rescale: the power-of-two rescaling of the cotangent (Sec. 5.4; on by default).
      rngs: the `nnx.Rngs` of the initializers (two `params` keys, kernel then bias).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, precision=None,
                 kernel_init=default_kernel_init, bias_init=default_bias_init,
                 axis_name: str = "tp", config=None, mode: str = "auto",
                 echo: Optional[EchoCarrier] = None, rescale: bool = True, rngs: nnx.Rngs):
        super().__init__(in_features, out_features, use_bias=use_bias, dtype=dtype,
                         param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                         bias_init=bias_init, axis_name=axis_name, config=config, mode=mode,
                         echo=echo, rescale=rescale, kernel_names=(None, axis_name),
                         bias_names=(axis_name,), rngs=rngs)

    def __call__(self, inputs, *, choice=None, echo: Optional[EchoCarrier] = None):
        """Applies the layer.

        Args:
          inputs: [..., in], replicated over `axis_name` (in "shard_map" mode, this rank's copy).
          choice: an int index into a tuple `config` (may be traced, e.g. the layer index).
          echo: the carrier for this call (instead of the one given at construction; e.g. the
            carry of an `nnx.scan` over layers).

        Returns:
          [..., out / P] in "shard_map" mode (this rank's features); [..., out] sharded over
          `axis_name` on its last dim in "gspmd" mode.
        """
        return self._site("column", inputs, choice, echo, "ColumnParallelLinear")


class RowParallelLinear(_ParallelLinear):
    """A row-parallel `nnx.Linear`: y = g(x @ kernel) + bias, input features split over the
    tensor-parallel axis.

    Megatron's second layer of a block (the Echo paper Sec. 5.4): each rank contracts its
    `in_features / P` input features with its rows of the kernel, and the partial sums are
    all-reduced by Echo (site g, `echo_jax.tp.forward_site`: Echo forward, identity backward);
    the bias is added once, after the reduction.

    Args:
      in_features: the number of input features of the whole (unsharded) layer.
      out_features: the number of output features.
      use_bias: whether to add a bias (replicated, added after the reduction).
      dtype, param_dtype, precision, kernel_init, bias_init, axis_name, config, mode, rngs: as
        `ColumnParallelLinear`'s (the kernel is [in, out] globally, split on `in`).
      echo: the model's `EchoCarrier` (the forward state "fwd" flows through it), or None.
      rescale: the power-of-two rescaling around the all-reduce (off by default in the forward
        pass, as the paper's).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, precision=None,
                 kernel_init=default_kernel_init, bias_init=default_bias_init,
                 axis_name: str = "tp", config=None, mode: str = "auto",
                 echo: Optional[EchoCarrier] = None, rescale: bool = False, rngs: nnx.Rngs):
        super().__init__(in_features, out_features, use_bias=use_bias, dtype=dtype,
                         param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                         bias_init=bias_init, axis_name=axis_name, config=config, mode=mode,
                         echo=echo, rescale=rescale, kernel_names=(axis_name, None),
                         bias_names=(None,), rngs=rngs)

    def __call__(self, inputs, *, choice=None, echo: Optional[EchoCarrier] = None):
        """Applies the layer.

        Args:
          inputs: [..., in] split over `axis_name` on its last dim (in "shard_map" mode, this
            rank's [..., in / P], e.g. a column-parallel layer's output).
          choice: an int index into a tuple `config` (may be traced).
          echo: the carrier for this call (instead of the one given at construction).

        Returns:
          [..., out], the reduced sum plus the bias, replicated over `axis_name`.
        """
        return self._site("row", inputs, choice, echo, "RowParallelLinear")


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "EchoCarrier", "EchoState"]
