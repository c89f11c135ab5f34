"""Flax Linen layers with Echo: `ColumnParallelDense`, `RowParallelDense` and `EchoCarrier`.

Drop-in replacements of `flax.linen.Dense` for Megatron's tensor-parallel MLP / attention (the
Echo paper, arXiv 2610.14277, Sec. 5.4): a column-parallel layer (the kernel's output features
split over `axis_name`; its input's cotangent all-reduced by Echo in the backward pass, site f)
followed by a row-parallel one (the kernel's input features split; the partial sums all-reduced
by Echo in the forward pass, site g; the bias added once, after the reduction).

    class MLP(nn.Module):
        config: EchoConfig | None = None

        @nn.compact
        def __call__(self, x):
            echo = EchoCarrier(self.config, name="echo")    # the compensator state's carrier
            echo.reset(x)                                   # zeros at the start of every pass
            h = ColumnParallelDense(256, config=self.config, echo=echo)(x)
            return RowParallelDense(64, config=self.config, echo=echo)(nn.gelu(h))

    y, state = MLP(cfg).apply(variables, x, mutable=["echo_state"])

Where the layers run (`mode`, see `echo_jax.flax`): inside `jax.shard_map` over `axis_name`
(per-rank code: the kernels are this rank's blocks) or in a `jax.jit` program under
`jax.set_mesh(mesh)` (the kernels are the global arrays, sharded over the mesh's `axis_name`);
"auto" tells them apart by whether `axis_name` is bound. The parameters are the same global
arrays either way, boxed with `nn.with_partitioning` (column kernel `(None, axis_name)`, its bias
`(axis_name,)`; row kernel `(axis_name, None)`, its bias replicated), so
`nn.get_partition_spec(variables)` gives the shard_map specs and jit's shardings. Initialized per
rank inside `jax.shard_map`, each rank keeps its slice of the global initializer's output
(`echo_jax.flax.sharded_init`), so the model holds the parameters `nn.Dense` would hold with the
same key.

The compensator state (Algorithm 1, Sec. 5.1) lives in the variable collection "echo_state" of an
`EchoCarrier`, one module shared by every layer of the model (pass it as the layers' `echo`
attribute): "fwd", the forward state, read and written by every row-parallel layer in call order;
"bwd", the backward state, threaded the same way through the column-parallel layers (returned
unchanged in the forward pass; in the backward pass its cotangent carries the live state from
site to site in backward order, as `echo_jax.tp.backward_site`). `reset(x)` at the start of every
forward pass makes both zeros shaped like x, in the config's `state_dtype`. Through
`nn.scan` over layers pass `variable_carry="echo_state"` (the carrier's variables are the loop's
carry); `nn.remat` needs nothing. Without a carrier (`echo=None`) the sites run uncompensated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from echo_jax import flax as core
from echo_jax import tp
from echo_jax.compensator import CompensatorState

COLLECTION = core.COLLECTION

default_kernel_init = nn.initializers.lecun_normal()


class EchoCarrier(nn.Module):
    """The compensator state of a model's Echo sites, in the variable collection "echo_state".

    One carrier per model (or per group of sites that reduce values of one shape), shared by its
    layers through their `echo` attribute. It holds two `CompensatorState`s: "fwd" (the forward
    state of the row-parallel sites) and "bwd" (the backward state of the column-parallel sites),
    each read and written by the sites in call order (the Echo paper Sec. 5.1 and 5.4).

    Attributes:
      config: the sites' `EchoConfig` (or tuple of them, or None): the state is made in its
        `state_dtype`.
      axis_name: the tensor-parallel axis.
      mode: "auto", "shard_map" or "gspmd", as the layers' (it decides whether the state is per
        rank or global [P, ...]).
    """

    config: Any = None
    axis_name: str = "tp"
    mode: str = "auto"

    def _writable(self, where):
        if not self.is_mutable_collection(COLLECTION):
            raise ValueError(
                f"EchoCarrier.{where}: the collection {COLLECTION!r} is not mutable: apply the "
                f"model with mutable=[{COLLECTION!r}] (the compensator state changes at every "
                "site)")

    def reset(self, like, bwd_like=None) -> None:
        """Zeros for both states; call it at the start of every forward pass.

        Args:
          like: a value shaped like the row-parallel sites' outputs (e.g. the residual stream
            [B, T, D], this rank's in "shard_map" mode); an array or a ShapeDtypeStruct.
          bwd_like: a value shaped like the column-parallel sites' inputs (default: `like`).
        """
        self._writable("reset")
        kw = dict(axis_name=self.axis_name, config=self.config, mode=self.mode,
                  where="EchoCarrier.reset")
        self.put_variable(COLLECTION, "fwd", core.zero_state(like, **kw))
        self.put_variable(COLLECTION, "bwd", core.zero_state(
            like if bwd_like is None else bwd_like, **kw))

    def get(self, kind: str) -> CompensatorState:
        """The current state of one direction ("fwd" or "bwd")."""
        if kind not in ("fwd", "bwd"):
            raise ValueError(f"EchoCarrier.get: kind must be 'fwd' or 'bwd', got {kind!r}")
        state = self.get_variable(COLLECTION, kind)
        if state is None:
            raise ValueError(
                "EchoCarrier: no compensator state: call carrier.reset(x) at the start of the "
                f"forward pass and apply with mutable=[{COLLECTION!r}]")
        return _as_state(state)

    def put(self, kind: str, state: CompensatorState) -> None:
        """Stores the state a site returned (the next site of that direction reads it)."""
        self._writable("put")
        self.put_variable(COLLECTION, kind, state)


def _as_state(state) -> CompensatorState:
    """A stored state as a CompensatorState (a restored checkpoint may hold a dict or a list)."""
    if isinstance(state, Mapping):
        return CompensatorState(state["m1"], state["m2"])
    return CompensatorState(*state)


def _param(module, name, init, shape, dtype, names, local):
    """A parameter boxed with `nn.with_partitioning(init, names)`; in shard_map mode unboxed
    without the sharding constraint (the value is this rank's block, the names the global
    array's layout)."""
    value = module.param(name, nn.with_partitioning(init, names), shape, dtype, unbox=not local)
    if local and isinstance(value, nn.Partitioned):
        value = value.unbox(apply_constraint=False)
    return value


class _ParallelDense(nn.Module):
    """What the two layers share (attributes as `flax.linen.Dense`'s, plus Echo's)."""

    features: int
    use_bias: bool = True
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    axis_name: str = "tp"
    config: Any = None
    echo: Optional[EchoCarrier] = None
    mode: str = "auto"

    def _check(self):
        where = type(self).__name__
        if self.mode not in core.MODES:
            raise ValueError(f"{where}: mode must be one of {core.MODES}, got {self.mode!r}")
        tp.check_site_configs(self.config, where)
        if self.echo is not None and not isinstance(self.echo, EchoCarrier):
            raise ValueError(f"{where}: echo must be an EchoCarrier or None, got "
                             f"{type(self.echo).__name__}")

    def _site(self, kind, inputs, kernel, bias, choice, where):
        """The layer's site ("column" or "row") on the promoted operands, its state threaded
        through the carrier `echo` (`echo_jax.flax.site_with_carrier`)."""
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return core.site_with_carrier(kind, inputs, kernel, bias, echo=self.echo,
                                      axis_name=self.axis_name, config=self.config, choice=choice,
                                      rescale=self.rescale, precision=self.precision,
                                      mode=self.mode, where=where)


class ColumnParallelDense(_ParallelDense):
    """A column-parallel `Dense`: y = f(x) @ kernel + bias, output features split over the axis.

    Megatron's first layer of a block (the Echo paper Sec. 5.4): the input x is replicated over
    `axis_name`; each rank multiplies it by its `features / P` columns of the kernel (no
    communication forward); in the backward pass the partial cotangents of x are all-reduced by
    Echo (site f, `echo_jax.tp.backward_site`), with the power-of-two rescaling (`rescale`).

    Attributes:
      features: the number of output features of the whole (unsharded) layer.
      use_bias: whether to add a bias (split over the axis like the kernel's columns).
      dtype: the computation dtype (default: inferred from the input and params, as Dense).
      param_dtype: the dtype of the parameters (default float32).
      precision: `lax.Precision` of the contraction.
      kernel_init, bias_init: initializers of the global kernel [in, features] and bias
        [features] (any Flax / JAX initializer; the layer adds the partitioning).
      axis_name: the tensor-parallel mesh axis.
      config: an `EchoConfig`, None (the exact `lax.psum`), or a tuple of them picked per call by
        `choice` (e.g. `echo_jax.tp.early_8bit_configs(cfg)`).
      echo: the model's `EchoCarrier` (the backward state "bwd" flows through it), or None
        (uncompensated).
      mode: "auto", "shard_map" or "gspmd" (see `echo_jax.flax`).
      rescale: the power-of-two rescaling of the cotangent (Sec. 5.4; on by default).
    """

    rescale: bool = True

    @nn.compact
    def __call__(self, inputs, *, choice=None):
        """Applies the layer.

        Args:
          inputs: [..., in], replicated over `axis_name` (in "shard_map" mode, this rank's copy).
          choice: an int index into a tuple `config` (may be traced, e.g. the layer index).

        Returns:
          [..., features / P] in "shard_map" mode (this rank's features); [..., features]
          sharded over `axis_name` on its last dim in "gspmd" mode.
        """
        where = "ColumnParallelDense"
        self._check()
        local = core.axis_bound(self.axis_name)
        n_in, ax = inputs.shape[-1], self.axis_name
        if local:
            p = core.axis_size("shard_map", ax)
            out = core.split_features(self.features, p, "features", where)
            k_init = core.sharded_init(self.kernel_init, (n_in, self.features), 1, ax)
            b_init = core.sharded_init(self.bias_init, (self.features,), 0, ax)
        else:
            out, k_init, b_init = self.features, self.kernel_init, self.bias_init
        kernel = _param(self, "kernel", k_init, (n_in, out), self.param_dtype, (None, ax), local)
        bias = _param(self, "bias", b_init, (out,), self.param_dtype, (ax,), local) \
            if self.use_bias else None
        return self._site("column", inputs, kernel, bias, choice, where)


class RowParallelDense(_ParallelDense):
    """A row-parallel `Dense`: y = g(x @ kernel) + bias, input features split over the axis.

    Megatron's second layer of a block (the Echo paper Sec. 5.4): each rank contracts its
    `in / P` input features with its rows of the kernel, and the partial sums are all-reduced by
    Echo (site g, `echo_jax.tp.forward_site`: Echo forward, identity backward); the bias is
    added once, after the reduction.

    Attributes:
      features: the number of output features.
      use_bias: whether to add a bias (replicated, added after the reduction).
      dtype, param_dtype, precision, kernel_init, bias_init, axis_name, config, mode: as
        `ColumnParallelDense`'s (the kernel is [in, features] globally, split on `in`).
      echo: the model's `EchoCarrier` (the forward state "fwd" flows through it), or None
        (uncompensated).
      rescale: the power-of-two rescaling around the all-reduce (off by default in the forward
        pass, as the paper's).
    """

    rescale: bool = False

    @nn.compact
    def __call__(self, inputs, *, choice=None):
        """Applies the layer.

        Args:
          inputs: [..., in] split over `axis_name` on its last dim (in "shard_map" mode, this
            rank's [..., in / P], e.g. a column-parallel layer's output).
          choice: an int index into a tuple `config` (may be traced).

        Returns:
          [..., features], the reduced sum plus the bias, replicated over `axis_name`.
        """
        where = "RowParallelDense"
        self._check()
        local = core.axis_bound(self.axis_name)
        n_in, ax = inputs.shape[-1], self.axis_name
        k_init = self.kernel_init
        if local:
            p = core.axis_size("shard_map", ax)
            k_init = core.sharded_init(self.kernel_init, (n_in * p, self.features), 0, ax)
        kernel = _param(self, "kernel", k_init, (n_in, self.features), self.param_dtype,
                        (ax, None), local)
        bias = _param(self, "bias", self.bias_init, (self.features,), self.param_dtype, (None,),
                      local) if self.use_bias else None
        return self._site("row", inputs, kernel, bias, choice, where)


__all__ = ["ColumnParallelDense", "RowParallelDense", "EchoCarrier", "COLLECTION"]
