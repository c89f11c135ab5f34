"""Flax Linen layers with Echo: `ColumnParallelDense`, `RowParallelDense` and `EchoCarrier`.

`flax.linen.Dense` as Megatron's column- and row-parallel pair, with an Echo all-reduce at each
of its two sites (the Echo paper, arXiv 2610.14277, Sec. 5.4; one definition of the two layers,
shared with NNX, in `echo_jax.flax.layer`):

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

The compensator state (Algorithm 1, Sec. 5.1; its "fwd" and "bwd" directions are told in
`echo_jax.flax.carrier`) lives in the variable collection "echo_state" of an `EchoCarrier`, one
module shared by every layer of the model (pass it as the layers' `echo` attribute); call
`reset(x)` at the start of every forward pass. Through `nn.scan` over layers pass
`variable_carry="echo_state"` (the carrier's variables are the loop's carry); `nn.remat` needs
nothing. Without a carrier (`echo=None`) the sites run uncompensated.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.module import _context, _unspecified_parent

from echo_jax.flax import layer
from echo_jax.flax.carrier import COLLECTION, CarrierMethods, without_state
from echo_jax.flax.sites import axis_bound, axis_size, sharded_init

default_kernel_init = nn.initializers.lecun_normal()


class EchoCarrier(CarrierMethods, nn.Module):
    """The compensator state of a model's Echo sites, in the variable collection "echo_state".

    Its methods (`reset`, `get`, `put`) are `echo_jax.flax.carrier.CarrierMethods`'; the two
    states are the variables "fwd" and "bwd" of the collection `COLLECTION`, so the model is
    applied with `mutable=["echo_state"]` and `nn.scan` carries them (`variable_carry`).

    Attributes:
      config, axis_name, mode: the sites' config, axis and mode (`CarrierMethods`).
    """

    config: Any = None
    axis_name: str = "tp"
    mode: str = "auto"

    _reset_hint: ClassVar[str] = f" and apply with mutable=[{COLLECTION!r}]"

    def _load(self, direction):
        return self.get_variable(COLLECTION, direction)

    def _store(self, direction, state, where):
        if not self.is_mutable_collection(COLLECTION):
            raise ValueError(
                f"EchoCarrier.{where}: the collection {COLLECTION!r} is not mutable: apply the "
                f"model with mutable=[{COLLECTION!r}] (the compensator state changes at every "
                "site)")
        self.put_variable(COLLECTION, direction, state)


class ParallelDense(nn.Module):
    """A tensor-parallel `flax.linen.Dense` of one `echo_jax.flax.layer.ParallelKind`.

    Attributes:
      features: the number of output features of the whole (unsharded) layer.
      use_bias: whether to add a bias.
      dtype: the computation dtype (default: inferred from the input and params, as Dense).
      param_dtype: the dtype of the parameters (default float32).
      precision: `lax.Precision` of the contraction.
      kernel_init, bias_init: initializers of the global kernel [in, features] and bias
        [features] (any Flax / JAX initializer; the layer adds the partitioning).
      axis_name: the tensor-parallel mesh axis.
      config: an `EchoConfig`, None (the exact `lax.psum`), or a tuple of them picked per call by
        `choice` (e.g. `echo_jax.tp.early_8bit_configs(cfg)`).
      echo: the model's `EchoCarrier`, or None (uncompensated).
      mode: "auto", "shard_map" or "gspmd" (see `echo_jax.flax`).
      rescale: the power-of-two rescaling around the all-reduce (the default: the kind's,
        `ParallelKind.rescale`).
    """

    kind: ClassVar[layer.ParallelKind]
    #: The auto-name prefix of the Flax layer this class replaces ("Dense": an unnamed layer is
    #: `Dense_0`, `Dense_1`, ..., counted with the parent's `nn.Dense`s), or None (the class
    #: name, Flax's default).
    replaces: ClassVar[Optional[str]] = None

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
    rescale: bool = False

    def __post_init__(self):
        # Flax names an unnamed submodule after its class (`ColumnParallelDense_0`); a drop-in
        # for nn.Dense takes Dense's name, so a model's parameter paths (and checkpoints) stay
        # the same when its nn.Dense layers are swapped for these.
        prefix = self._auto_name_prefix()
        parent = self.parent
        if parent is _unspecified_parent:           # Flax's default: the module being defined
            parent = _context.module_stack[-1]
        if (prefix is not None and self.name is None and isinstance(parent, nn.Module)
                and not parent._state.in_setup and parent._initialization_allowed):
            cursor = parent._state.autoname_cursor.get(prefix, 0)
            object.__setattr__(self, "name", f"{prefix}_{cursor}")
            parent._state.autoname_cursor[prefix] = cursor + 1
        super().__post_init__()

    @classmethod
    def _auto_name_prefix(cls) -> Optional[str]:
        """`replaces` in the class name (a lifted `nn.remat(ColumnParallelDense)` is
        `CheckpointDense_0`, as `nn.remat(nn.Dense)`'s); None for a user's subclass."""
        for base in cls.__mro__:
            if base.__dict__.get("replaces"):
                if base.__name__ in cls.__name__:
                    return cls.__name__.replace(base.__name__, base.__dict__["replaces"])
                return None
        return None

    def _param(self, name, init, global_shape, sharding, split_dim, p):
        """A parameter boxed with `nn.with_partitioning(init, sharding)`.

        In shard_map mode (`p`, the axis size, not None) a parameter split on `split_dim` is this
        rank's block, initialized as the global parameter's slice (`sharded_init`); there the
        value is unboxed without the sharding constraint (the names are the global layout)."""
        local = p is not None
        shape = tuple(global_shape)
        if local and split_dim is not None:
            shape = layer.block_shape(global_shape, split_dim, p, "features", type(self).__name__)
            init = sharded_init(init, global_shape, split_dim, self.axis_name)
        value = self.param(name, nn.with_partitioning(init, sharding), shape, self.param_dtype,
                           unbox=not local)
        if local and isinstance(value, nn.Partitioned):
            value = value.unbox(apply_constraint=False)
        return value

    @nn.compact
    def __call__(self, inputs, *, choice=None):
        """Applies the layer.

        Args:
          inputs: [..., in]: column-parallel, replicated over `axis_name`; row-parallel, split
            over it on the last dim (in "shard_map" mode, this rank's copy or block).
          choice: an int index into a tuple `config` (may be traced, e.g. the layer index).

        Returns:
          Column-parallel: [..., features / P] in "shard_map" mode (this rank's features),
          [..., features] sharded over `axis_name` on its last dim in "gspmd" mode.
          Row-parallel: [..., features], the reduced sum plus the bias, replicated over the axis.
        """
        where, kind, ax = type(self).__name__, self.kind, self.axis_name
        layer.check_layer(where, mode=self.mode, config=self.config, echo=self.echo,
                          carrier_type=EchoCarrier)
        p = axis_size("shard_map", ax) if axis_bound(ax) else None
        n_in = kind.global_in_features(inputs.shape[-1], p or 1)
        kernel = self._param("kernel", self.kernel_init, (n_in, self.features),
                             kind.kernel_sharding(ax), kind.kernel_split_dim, p)
        bias = self._param("bias", self.bias_init, (self.features,), kind.bias_sharding(ax),
                           kind.bias_split_dim(), p) if self.use_bias else None
        return layer.apply_site(kind, inputs, kernel, bias, dtype=self.dtype, echo=self.echo,
                                axis_name=ax, config=self.config, choice=choice,
                                rescale=self.rescale, precision=self.precision, mode=self.mode,
                                where=where)


class ColumnParallelDense(ParallelDense):
    """A column-parallel `Dense`: y = f(x) @ kernel + bias, output features split over the axis.

    Megatron's first layer of a block (`echo_jax.flax.layer.COLUMN`): each rank multiplies the
    replicated input by its `features / P` columns of the kernel (no communication forward); in
    the backward pass Echo all-reduces the partial cotangents of x (site f), rescaled by a power
    of two (`rescale`, on by default). The bias is split like the kernel's columns; `echo`'s
    backward state "bwd" flows through the layer. Attributes as `ParallelDense`'s.
    """

    kind: ClassVar[layer.ParallelKind] = layer.COLUMN
    replaces: ClassVar[Optional[str]] = "Dense"
    rescale: bool = layer.COLUMN.rescale


class FusedColumnParallelDense(ParallelDense):
    """Several column-parallel `Dense`s on one input, with one backward Echo all-reduce.

    Megatron's fused QKV (or gate / up) projection: `features=(q, k, v)` returns a tuple of
    outputs, each as `ColumnParallelDense(f_i)`'s (this rank's `f_i / P` features per rank, so
    each rank gets its own heads of q, k and v), but the input enters through one site f: in the
    backward pass the summed cotangent of x is all-reduced once, where three separate layers
    would all-reduce it three times.

    Parameters: `kernel_{i}` [in, f_i] and `bias_{i}` [f_i] per output i, each split over the
    axis on its features (`(None, axis_name)`, `(axis_name,)`): the parameters of separate
    column layers `i`, renamed (`params["kernel_0"] = params_q["kernel"]`, ...). Attributes as
    `ParallelDense`'s, with `features` a sequence of output sizes (each divisible by P).
    """

    kind: ClassVar[layer.ParallelKind] = layer.COLUMN
    features: Sequence[int] = ()
    rescale: bool = layer.COLUMN.rescale

    @nn.compact
    def __call__(self, inputs, *, choice=None):
        """Applies the layer: a tuple with one output per entry of `features` (see
        `ColumnParallelDense.__call__` for each output's shape)."""
        where, kind, ax = type(self).__name__, self.kind, self.axis_name
        layer.check_layer(where, mode=self.mode, config=self.config, echo=self.echo,
                          carrier_type=EchoCarrier)
        if not self.features:
            raise ValueError(f"{where}: features must be a non-empty sequence of output sizes")
        p = axis_size("shard_map", ax) if axis_bound(ax) else None
        n_in = inputs.shape[-1]
        kernels, biases = [], []
        for i, f in enumerate(self.features):
            kernels.append(self._param(f"kernel_{i}", self.kernel_init, (n_in, f),
                                       kind.kernel_sharding(ax), kind.kernel_split_dim, p))
            biases.append(self._param(f"bias_{i}", self.bias_init, (f,), kind.bias_sharding(ax),
                                      kind.bias_split_dim(), p) if self.use_bias else None)
        return layer.apply_fused_column(inputs, kernels, biases, dtype=self.dtype,
                                        echo=self.echo, axis_name=ax, config=self.config,
                                        choice=choice, rescale=self.rescale,
                                        precision=self.precision, mode=self.mode, where=where)


class RowParallelDense(ParallelDense):
    """A row-parallel `Dense`: y = g(x @ kernel) + bias, input features split over the axis.

    Megatron's second layer of a block (`echo_jax.flax.layer.ROW`): each rank contracts its
    `in / P` input features with its rows of the kernel and Echo all-reduces the partial sums
    (site g: Echo forward, identity backward; `rescale` off by default); the replicated bias is
    added once, after the reduction. `echo`'s forward state "fwd" flows through the layer.
    Attributes as `ParallelDense`'s.
    """

    kind: ClassVar[layer.ParallelKind] = layer.ROW
    replaces: ClassVar[Optional[str]] = "Dense"
    rescale: bool = layer.ROW.rescale


__all__ = ["ColumnParallelDense", "RowParallelDense", "FusedColumnParallelDense", "ParallelDense",
           "EchoCarrier", "COLLECTION", "without_state"]
