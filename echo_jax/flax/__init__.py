"""Echo in Flax models: tensor-parallel dense layers and the compensator state, the Flax way.

    from echo_jax.flax import linen as ejnn   # ColumnParallelDense, RowParallelDense, EchoCarrier
    from echo_jax.flax import nnx as ejnnx    # ColumnParallelLinear, RowParallelLinear, EchoCarrier

Megatron's two layers with Echo at their sites (the Echo paper, arXiv 2610.14277, Sec. 5.4):

* column-parallel (kernel [in, out] split over `axis_name` on `out`): the input enters through
  the backward site f (identity forward; the Echo all-reduce of its cotangent backward), the
  output is this rank's `out / P` features;
* row-parallel (kernel split over `axis_name` on `in`): the local contraction, then the forward
  site g (the Echo all-reduce of the partial sums forward; identity backward), then the bias,
  once.

The Linen and NNX layers share one definition, in the modules beside them:

* `echo_jax.flax.sites` (no Flax import): how a layer knows where it runs (`resolve_mode`), the
  two sites on a kernel (`column_parallel`, `row_parallel`; `site_with_carrier` threads a
  carrier's state through one) and the compensator state of a pass (`zero_state`,
  `check_state`); re-exported here;
* `echo_jax.flax.layer`: the two layers (`COLUMN`, `ROW`: how each splits its parameters, which
  site it runs) and their forward (`apply_site`);
* `echo_jax.flax.carrier`: what a carrier does (`reset`, `get`, `put`), `COLLECTION` and
  `without_state` (a Linen model's variables to checkpoint: the parameters without the state).

Modes (`mode=`):

* "shard_map": per-rank code, inside `jax.shard_map` over `axis_name` (or `jax.vmap` with
  `axis_name`, the one-device simulation). The kernel is this rank's block (column: [in, out/P],
  row: [in/P, out]); the sites are `echo_jax.tp.backward_site` / `forward_site`; the state is per
  rank, shaped like the reduced value.
* "gspmd": a `jax.jit` program whose arrays carry shardings (`jax.set_mesh(mesh)`): the kernel is
  the global array, sharded over the mesh's `axis_name`; the sites are
  `echo_jax.gspmd.column_parallel_matmul` / `row_parallel_matmul` (one shard_map manual over
  every mesh axis of size > 1); the state is global, [P, *value.shape] (`gspmd.state_for`).
* "auto" (the default): "shard_map" where `axis_name` is bound (`lax.axis_size` answers),
  else "gspmd" where a mesh is set (`jax.set_mesh`) or the kernel is a concrete array with a
  `NamedSharding`, else "local": no mesh and no axis, one device: the plain dense layer (nothing
  to reduce), as on a mesh whose `axis_name` has size 1.

Site configs (`config=`): an `EchoConfig`, None (the exact `lax.psum` through the same code), or a
tuple of them with a (traced) `choice` index per call (the early-8-bit policy of Sec. 7.2,
`echo_jax.tp.early_8bit_configs`, or a calibrated per-site policy).
"""

from echo_jax.flax.carrier import COLLECTION, without_state
from echo_jax.flax.sites import (MODES, axis_bound, axis_size, check_state, column_parallel,
                                 resolve_mode, row_parallel, sharded_init, site_with_carrier,
                                 split_features, state_dtype, zero_state)

__all__ = ["COLLECTION", "without_state", "MODES", "axis_bound", "resolve_mode", "axis_size",
           "state_dtype", "zero_state", "check_state", "column_parallel", "row_parallel", "site_with_carrier",
           "sharded_init", "split_features"]
