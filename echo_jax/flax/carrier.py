"""The compensator state's carrier, one definition for Linen and NNX.

A carrier holds the compensator state (Algorithm 1, the Echo paper Sec. 5.1) of a model's Echo
sites: "fwd", the forward state, read and written by every row-parallel site in call order, and
"bwd", the backward state, threaded the same way through the column-parallel sites (returned
unchanged in the forward pass; in the backward pass its cotangent carries the live state from
site to site in backward order, as `echo_jax.tp.backward_site`). `reset(x)` at the start of every
forward pass makes both zeros shaped like x, in the config's `state_dtype`.

The state is scratch, not model state: it is remade at every pass and never read across passes,
so a checkpoint holds the parameters only (`without_state` drops the Linen collection; NNX:
`nnx.state(model, nnx.Not(EchoState))`). Per site route it is 2 directions x (m1, m2) arrays of
the reduced value's shape (per rank; `[P, *shape]` in "gspmd" mode) in the state dtype.

`CarrierMethods` is what a carrier does (`reset`, `get`, `put`); the Linen `EchoCarrier` (its
state in the variable collection `COLLECTION`) and the NNX `EchoCarrier` (its state in two
`EchoState` variables) only say where the two states are stored (`_load` and `_store`).
"""

from __future__ import annotations

from collections.abc import Mapping

from echo_jax.compensator import CompensatorState, as_carrier
from echo_jax.flax.sites import zero_state

#: The Linen variable collection of the compensator state (pass `mutable=[COLLECTION]`).
COLLECTION = "echo_state"
#: The two states of a carrier: the row-parallel sites' ("fwd"), the column-parallel ones'
#: ("bwd").
DIRECTIONS = ("fwd", "bwd")


def stored_state(value) -> CompensatorState:
    """A stored state as a `CompensatorState` (a restored checkpoint may hold a dict or a list).

    Args:
      value: a `CompensatorState`, a mapping with "m1" and "m2", or a pair (m1, m2).

    Returns:
      CompensatorState(m1, m2).
    """
    if isinstance(value, Mapping):
        return CompensatorState(value["m1"], value["m2"])
    return CompensatorState(*value)


def without_state(variables):
    """A Linen model's variables without the compensator state (the collection `COLLECTION`).

    What to checkpoint: the state is remade by every pass (`reset`), so saving it only doubles
    the checkpoint and ties it to one batch shape. `model.init` returns it with the parameters;
    filter it out before saving, and out of the target before restoring.

    Args:
      variables: a mapping of collections (`model.init`'s output, or a restored checkpoint).

    Returns:
      The same kind of mapping (a `FrozenDict` stays one) without `COLLECTION`.
    """
    kept = {k: v for k, v in variables.items() if k != COLLECTION}
    if not isinstance(variables, dict):
        try:
            return type(variables)(kept)
        except TypeError:
            pass
    return kept


class CarrierMethods:
    """The methods of an `EchoCarrier` (Linen or NNX), on the framework's storage.

    One carrier per model (or per group of sites that reduce values of one shape), shared by its
    layers; each direction's state is read and written by the sites in call order (the Echo
    paper Sec. 5.1 and 5.4). A carrier class mixes this in and defines:

    * the attributes `config`, `axis_name` and `mode`;
    * `_load(direction)`: the stored state (None before the first `reset`);
    * `_store(direction, state, where)`: stores it (`where`, the method, for messages);
    * `_reset_hint`: what the error of a `get` before any `reset` adds to its fix.

    Attributes:
      config: the sites' `EchoConfig` (or tuple of them, or None): the state is made in its
        `state_dtype`.
      axis_name: the tensor-parallel axis.
      mode: "auto", "shard_map" or "gspmd", as the layers' (it decides whether the state is per
        rank or global [P, ...]).
    """

    _reset_hint = ""

    def reset(self, like, bwd_like=None) -> None:
        """Zeros for both states; call it at the start of every forward pass.

        Args:
          like: a value shaped like the row-parallel sites' outputs (e.g. the residual stream
            [B, T, D], this rank's in "shard_map" mode); an array or a ShapeDtypeStruct.
          bwd_like: a value shaped like the column-parallel sites' inputs (default: `like`).
        """
        made = dict(axis_name=self.axis_name, config=self.config, mode=self.mode,
                    where="EchoCarrier.reset")
        self._store("fwd", zero_state(like, **made), "reset")
        # The backward state in the form the column-parallel sites return it (an int8 state's
        # codes in the float carrier of `echo_jax.tp.backward_site`), so that it keeps its type
        # from site to site (a scan carry).
        self._store("bwd", as_carrier(zero_state(like if bwd_like is None else bwd_like,
                                                 **made)), "reset")

    def get(self, kind: str) -> CompensatorState:
        """The current state of one direction.

        Args:
          kind: "fwd" or "bwd".

        Returns:
          The `CompensatorState` the next site of that direction reads.

        Raises:
          ValueError: an unknown `kind`, or no state yet (no `reset` in this pass).
        """
        if kind not in DIRECTIONS:
            raise ValueError(f"EchoCarrier.get: kind must be 'fwd' or 'bwd', got {kind!r}")
        state = self._load(kind)
        if state is None:
            raise ValueError("EchoCarrier: no compensator state: call carrier.reset(x) at the "
                             f"start of the forward pass{self._reset_hint}")
        return stored_state(state)

    def put(self, kind: str, state: CompensatorState) -> None:
        """Stores the state a site returned (the next site of that direction reads it).

        Args:
          kind: "fwd" or "bwd".
          state: the site's new `CompensatorState`.
        """
        self._store(kind, state, "put")


__all__ = ["COLLECTION", "DIRECTIONS", "CarrierMethods", "stored_state", "without_state"]
