"""Flax NNX layers with Echo: `ColumnParallelLinear`, `RowParallelLinear`, `EchoCarrier`.

Drop-in replacements of `flax.nnx.Linear` for the column- and row-parallel layers of Megatron's
MLP and attention blocks with Echo at their sites (the Echo paper, arXiv 2610.14277, Sec. 5.4;
the layers are defined once, for Linen and NNX, in `echo_jax.flax.layer`):

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

The compensator state (Algorithm 1, Sec. 5.1; its "fwd" and "bwd" directions are told in
`echo_jax.flax.carrier`) is two `EchoState` variables (an `nnx.Variable` subclass holding a
`CompensatorState`) of an `EchoCarrier` shared by the model's layers; `reset(x)` at the start of
every forward pass assigns zeros shaped like x (`Variable.set_value`, which takes a new shape;
`v[...] = ` would write into the old shape). Through `nnx.scan` over stacked layers, carry the
carrier (`in_axes=(nnx.Carry, 0)` with `(x, carrier)` as the carry) and pass it at call time
(`layer(x, echo=carrier)`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_bias_init, default_kernel_init

from echo_jax.flax import layer
from echo_jax.flax.carrier import CarrierMethods
from echo_jax.flax.sites import axis_bound, axis_size, state_dtype


class EchoState(nnx.Variable):
    """An Echo compensator state (a `CompensatorState` (m1, m2), or None before the first pass).

    A Variable type of its own, so that filters select it: `nnx.state(model, EchoState)`, or
    `nnx.split(model, nnx.Param, EchoState)`; optimizers (`wrt=nnx.Param`) and `nnx.grad` leave
    it alone.
    """


class EchoCarrier(CarrierMethods, nnx.Module):
    """The compensator state of a model's Echo sites: two `EchoState` variables.

    Its methods (`reset`, `get`, `put`) are `echo_jax.flax.carrier.CarrierMethods`'; the two
    states are its `EchoState` variables `fwd` and `bwd`. `reset` assigns them with
    `Variable.set_value`, which takes a new shape (a new batch size or a KV-cache decoding step
    makes a new state). Layers take it at construction or per call (`echo=`).

    Args:
      config, axis_name, mode: the sites' config, axis and mode (`CarrierMethods`).
    """

    def __init__(self, config: Any = None, *, axis_name: str = "tp", mode: str = "auto"):
        state_dtype(config)  # checks the configs agree on it
        self.config = config
        self.axis_name = axis_name
        self.mode = mode
        self.fwd = EchoState(None)
        self.bwd = EchoState(None)

    def _load(self, direction):
        return getattr(self, direction).get_value()

    def _store(self, direction, state, where):
        del where
        getattr(self, direction).set_value(state)

    def clear(self) -> None:
        """Drops both states (the variables hold None again, as before the first pass).

        End a pass with it where the next call is jitted (`nnx.jit` decoding): the state a pass
        leaves is an input of the next jitted call, and its shape a key of jit's cache, so a
        prefill-shaped state left for the first decoding step (and a step-shaped one for the
        next prefill) compiles the step again though the pass never reads it (it resets). With
        the state cleared, each input shape compiles once. The final state is then gone: skip
        `clear` to inspect it.
        """
        self.fwd.set_value(None)
        self.bwd.set_value(None)


#: The NNX filter of a model's state without the compensator state: what to checkpoint
#: (`nnx.state(model, MODEL_STATE)`, the same as `nnx.state(model, nnx.Not(EchoState))`).
MODEL_STATE = nnx.Not(EchoState)


def without_state(model):
    """The model's state to checkpoint: every variable but the compensator state (`EchoState`).

    The state is remade by every pass (`EchoCarrier.reset`), so it is not model state; saving it
    ties a checkpoint to one batch shape. Restore into `without_state(target_model)` (orbax's
    target) and apply with `nnx.update(model, restored)`.

    Args:
      model: an NNX module (or a graph of them).

    Returns:
      `nnx.state(model, nnx.Not(EchoState))`.
    """
    return nnx.state(model, MODEL_STATE)


def _param(value, sharding):
    """An `nnx.Param` with the sharding metadata `sharding`; sharded as created where a mesh is
    set (NNX's eager sharding), kept as metadata only where none is."""
    if jax.sharding.get_abstract_mesh().empty:
        return nnx.Param(value, out_sharding=sharding, eager_sharding=False)
    return nnx.Param(value, out_sharding=sharding)


def _keep_settings(layer, in_features, out_features, use_bias, dtype, param_dtype, precision,
                   axis_name, config, mode, echo, rescale):
    """Stores a layer's constructor arguments as its attributes (as `nnx.Linear` does); rescale
    None takes the layer kind's default."""
    layer.in_features = in_features
    layer.out_features = out_features
    layer.use_bias = use_bias
    layer.dtype = dtype
    layer.param_dtype = param_dtype
    layer.precision = precision
    layer.axis_name = axis_name
    layer.config = config
    layer.mode = mode
    layer.echo = echo
    layer.rescale = layer.kind.rescale if rescale is None else rescale


class ParallelLinear(nnx.Module):
    """A tensor-parallel `flax.nnx.Linear` of one `echo_jax.flax.layer.ParallelKind`.

    Args:
      in_features: the number of input features of the whole (unsharded) layer.
      out_features: the number of output features of the whole layer.
      use_bias: whether to add a bias.
      dtype: the computation dtype (default: inferred from the input and params, as Linear).
      param_dtype: the dtype of the parameters (default float32).
      precision: `lax.Precision` of the contraction.
      kernel_init, bias_init: initializers of the global kernel [in, out] and bias [out] (any
        Flax / JAX initializer; the layer adds the sharding metadata).
      axis_name: the tensor-parallel mesh axis.
      config: an `EchoConfig`, None (the exact `lax.psum`), or a tuple of them picked per call by
        `choice` (e.g. `echo_jax.tp.early_8bit_configs(cfg)`).
      mode: "auto", "shard_map" or "gspmd" (see `echo_jax.flax`).
      echo: the model's `EchoCarrier`, or None (uncompensated, unless one is passed per call).
      rescale: the power-of-two rescaling around the all-reduce (None: the kind's default,
        `ParallelKind.rescale`: on for the column-parallel layer, off for the row-parallel one).
      rngs: the `nnx.Rngs` of the initializers (two `params` keys, kernel then bias).
    """

    kind: ClassVar[layer.ParallelKind]

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, precision=None,
                 kernel_init=default_kernel_init, bias_init=default_bias_init,
                 axis_name: str = "tp", config=None, mode: str = "auto",
                 echo: Optional[EchoCarrier] = None, rescale: Optional[bool] = None,
                 rngs: nnx.Rngs):
        layer.check_layer(type(self).__name__, mode=mode, config=config, echo=echo,
                          carrier_type=EchoCarrier)
        kernel_key = rngs.params()
        self.kernel = _param(kernel_init(kernel_key, (in_features, out_features), param_dtype),
                             self.kind.kernel_sharding(axis_name))
        if use_bias:
            bias_key = rngs.params()
            self.bias = _param(bias_init(bias_key, (out_features,), param_dtype),
                               self.kind.bias_sharding(axis_name))
        else:
            self.bias = nnx.data(None)
        _keep_settings(self, in_features, out_features, use_bias, dtype, param_dtype, precision,
                       axis_name, config, mode, echo, rescale)

    def __call__(self, inputs, *, choice=None, echo: Optional[EchoCarrier] = None):
        """Applies the layer.

        Args:
          inputs: [..., in]: column-parallel, replicated over `axis_name`; row-parallel, split
            over it on the last dim (in "shard_map" mode, this rank's copy or block).
          choice: an int index into a tuple `config` (may be traced, e.g. the layer index).
          echo: the carrier for this call (instead of the one given at construction; e.g. the
            carry of an `nnx.scan` over layers).

        Returns:
          Column-parallel: [..., out / P] in "shard_map" mode (this rank's features), [..., out]
          sharded over `axis_name` on its last dim in "gspmd" mode. Row-parallel: [..., out],
          the reduced sum plus the bias, replicated over `axis_name`.
        """
        where = type(self).__name__
        echo = self.echo if echo is None else echo
        layer.check_layer(where, mode=self.mode, config=self.config, echo=echo,
                          carrier_type=EchoCarrier)
        kernel = self.kernel[...]
        self._check_block(kernel)
        bias = self.bias[...] if self.bias is not None else None
        return layer.apply_site(self.kind, inputs, kernel, bias, dtype=self.dtype, echo=echo,
                                axis_name=self.axis_name, config=self.config, choice=choice,
                                rescale=self.rescale, precision=self.precision, mode=self.mode,
                                where=where)

    def _check_block(self, kernel):
        """In shard_map mode the kernel must be this rank's block: a clear error otherwise."""
        if not axis_bound(self.axis_name):
            return
        p = axis_size("shard_map", self.axis_name)
        dim = self.kind.kernel_split_dim
        what = ("in_features", "out_features")[dim]
        want = layer.block_shape((self.in_features, self.out_features), dim, p, what,
                                 type(self).__name__)
        if tuple(kernel.shape) != want:
            raise ValueError(
                f"{type(self).__name__}: inside a shard_map over {self.axis_name!r} (P = {p}) the "
                f"kernel must be this rank's block {want} ({what} split over the axis), got "
                f"{tuple(kernel.shape)}: pass the model's state into shard_map with the specs "
                "of nnx.get_partition_spec(state)")


class ColumnParallelLinear(ParallelLinear):
    """A column-parallel `nnx.Linear`: y = f(x) @ kernel + bias, output features split over the
    tensor-parallel axis.

    Megatron's first layer of a block (`echo_jax.flax.layer.COLUMN`): each rank multiplies the
    replicated input by its `out_features / P` columns of the kernel (no communication forward);
    in the backward pass Echo all-reduces the partial cotangents of x (site f), rescaled by a
    power of two (`rescale`, on by default). The bias is split like the kernel's columns; the
    carrier's backward state "bwd" flows through the layer. Arguments as `ParallelLinear`'s.
    """

    kind: ClassVar[layer.ParallelKind] = layer.COLUMN


class FusedColumnParallelLinear(nnx.Module):
    """Several column-parallel `nnx.Linear`s on one input, with one backward Echo all-reduce.

    Megatron's fused QKV (or gate / up) projection: `out_features=(q, k, v)` returns a tuple of
    outputs, each as `ColumnParallelLinear(in_features, f_i)`'s (per rank this rank's `f_i / P`
    features, so each rank gets its own heads of q, k and v), but the input enters through one
    site f: in the backward pass the summed cotangent of x is all-reduced once, where separate
    layers would all-reduce it once each.

    Parameters: `kernel_{i}` [in, f_i] and `bias_{i}` [f_i] per output i (`nnx.Param`s with the
    column layer's sharding metadata), drawn from `rngs` in the order of separate
    `nnx.Linear(in_features, f_i)` layers made one after the other (kernel_0, bias_0, kernel_1,
    ...), so the same seed gives their values. Arguments as `ParallelLinear`'s, with
    `out_features` a sequence of output sizes (each divisible by P).
    """

    kind: ClassVar[layer.ParallelKind] = layer.COLUMN

    def __init__(self, in_features: int, out_features: Sequence[int], *, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, precision=None,
                 kernel_init=default_kernel_init, bias_init=default_bias_init,
                 axis_name: str = "tp", config=None, mode: str = "auto",
                 echo: Optional[EchoCarrier] = None, rescale: Optional[bool] = None,
                 rngs: nnx.Rngs):
        where = type(self).__name__
        layer.check_layer(where, mode=mode, config=config, echo=echo, carrier_type=EchoCarrier)
        out_features = tuple(int(f) for f in out_features)
        if not out_features:
            raise ValueError(f"{where}: out_features must be a non-empty sequence of sizes")
        for i, f in enumerate(out_features):
            setattr(self, f"kernel_{i}", _param(kernel_init(rngs.params(), (in_features, f),
                                                            param_dtype),
                                                self.kind.kernel_sharding(axis_name)))
            setattr(self, f"bias_{i}", _param(bias_init(rngs.params(), (f,), param_dtype),
                                              self.kind.bias_sharding(axis_name))
                    if use_bias else nnx.data(None))
        _keep_settings(self, in_features, out_features, use_bias, dtype, param_dtype, precision,
                       axis_name, config, mode, echo, rescale)

    def __call__(self, inputs, *, choice=None, echo: Optional[EchoCarrier] = None):
        """Applies the layer: a tuple with one output per entry of `out_features` (each as
        `ColumnParallelLinear.__call__`'s); `choice` and `echo` as there."""
        where = type(self).__name__
        echo = self.echo if echo is None else echo
        layer.check_layer(where, mode=self.mode, config=self.config, echo=echo,
                          carrier_type=EchoCarrier)
        n = len(self.out_features)
        kernels = [getattr(self, f"kernel_{i}")[...] for i in range(n)]
        biases = [getattr(self, f"bias_{i}")[...] if self.use_bias else None for i in range(n)]
        if axis_bound(self.axis_name):
            p = axis_size("shard_map", self.axis_name)
            for f, k in zip(self.out_features, kernels):
                want = layer.block_shape((self.in_features, f), 1, p, "out_features", where)
                if tuple(k.shape) != want:
                    raise ValueError(
                        f"{where}: inside a shard_map over {self.axis_name!r} (P = {p}) each "
                        f"kernel must be this rank's block {want}, got {tuple(k.shape)}: pass "
                        "the model's state into shard_map with the specs of "
                        "nnx.get_partition_spec(state)")
        return layer.apply_fused_column(inputs, kernels, biases, dtype=self.dtype, echo=echo,
                                        axis_name=self.axis_name, config=self.config,
                                        choice=choice, rescale=self.rescale,
                                        precision=self.precision, mode=self.mode, where=where)


class RowParallelLinear(ParallelLinear):
    """A row-parallel `nnx.Linear`: y = g(x @ kernel) + bias, input features split over the
    tensor-parallel axis.

    Megatron's second layer of a block (`echo_jax.flax.layer.ROW`): each rank contracts its
    `in_features / P` input features with its rows of the kernel and Echo all-reduces the
    partial sums (site g: Echo forward, identity backward; `rescale` off by default); the
    replicated bias is added once, after the reduction. The carrier's forward state "fwd" flows
    through the layer. Arguments as `ParallelLinear`'s.
    """

    kind: ClassVar[layer.ParallelKind] = layer.ROW


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "FusedColumnParallelLinear",
           "ParallelLinear", "EchoCarrier", "EchoState", "MODEL_STATE", "without_state"]
