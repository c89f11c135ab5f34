r"""Toy demo of error accumulation over a pass of tensor-parallel all-reduces.

A scanned residual stack of N tensor-parallel blocks (the noise process of the Echo paper,
Sec. 3.2) runs at P ranks once per all-reduce mode, and for each mode the demo measures the error
the all-reduce adds at every site and how those errors build up over the pass:

    z_{k+1} = z_k + y_k,        y_k = AllReduce_k({x_{k,i}}_i)                       (Eq. 2/3)
    rho_k   = y_k - sum_i x_{k,i}      net error added at site k (delta_k + C_k)     (Eq. 5)
    S_t     = sum_{k <= t} rho_k       accumulated error                             (Eq. 6)

Block k is a Megatron MLP: rank i holds a column shard of W1_k and the matching row shard of W2_k
and contributes x_{k,i} = gelu(rmsnorm(z_k) @ W1_k[:, shard_i]) @ W2_k[shard_i, :]. The exact sum
sum_i x_{k,i} is computed beside every all-reduce with an fp32 `lax.psum` of the raw contributions,
so rho_k is measured inside the same run, on that mode's own trajectory.

Modes: "16-bit" (psum of the contributions rounded to bfloat16, what a 16-bit NCCL all-reduce
returns), "8-bit" and "4-bit" (`echo_psum` without compensation, so rho_k = delta_k) and
"4-bit comp" (`echo_psum` with the two-timescale compensator of Algorithm 1, its state threaded
through the scan carry from zeros). A run with an exact fp32 psum is the reference trajectory for
the final output error.

Theorem 1 bounds the compensated partial sums at gain eta = 1 by (1 + mu_w) q, with q the largest
injected error ||delta_k||, against N q without compensation; at gain eta < 1 Eq. 21 gives
((1 - eta) N + eta (1 + mu_w)) q. `theorem1_factor` and `eq21_factor` compute these constants.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from echo_jax import compensator as comp
from echo_jax.collective import echo_psum
from echo_jax.config import EchoConfig

AXIS = "tp"

#: Names of the rows of the demo, in the order they are printed.
MODE_NAMES = ("16-bit", "8-bit", "4-bit", "4-bit comp")

#: Per-row quantities (besides "mode"), in the order of the JSON rows and the table columns.
ROW_KEYS = ("mean_site_error", "max_site_error", "max_injected_error", "max_partial_sum",
            "accumulation_ratio", "final_rel_error")

_RMS_EPS = 1e-6


# --------------------------------------------------------------------------------------------
# Constants of the compensator (Sec. 5.2 and Theorem 1)


def _weight_params(config, blend, beta1, beta2):
    base = EchoConfig() if config is None else config
    a = base.blend if blend is None else float(blend)
    b1 = base.beta1 if beta1 is None else float(beta1)
    b2 = base.beta2 if beta2 is None else float(beta2)
    for name, v, hi_ok in (("blend", a, True), ("beta1", b1, False), ("beta2", b2, False)):
        if not (0.0 <= v <= 1.0) or (not hi_ok and v >= 1.0):
            raise ValueError(f"{name} must be in [0, 1{']' if hi_ok else ')'}, got {v!r}")
    return a, b1, b2


def compensator_weights(num_terms: int, config: Optional[EchoConfig] = None, *,
                        blend: Optional[float] = None, beta1: Optional[float] = None,
                        beta2: Optional[float] = None) -> np.ndarray:
    """Weights w_r the compensator puts on an error of age r (Eq. 12).

        w_r = a (1 - beta1) beta1^r + (1 - a) (1 - beta2) beta2^r,   sum_{r >= 0} w_r = 1.

    Args:
      num_terms: how many weights to return (r = 0 .. num_terms - 1).
      config: an `EchoConfig` whose blend/beta1/beta2 are used (default: `EchoConfig()`).
      blend, beta1, beta2: override the config's a, beta1, beta2.

    Returns:
      float64 array [num_terms].
    """
    a, b1, b2 = _weight_params(config, blend, beta1, beta2)
    r = np.arange(num_terms, dtype=np.float64)
    return a * (1 - b1) * b1 ** r + (1 - a) * (1 - b2) * b2 ** r


def mean_age(config: Optional[EchoConfig] = None, *, blend: Optional[float] = None,
             beta1: Optional[float] = None, beta2: Optional[float] = None) -> float:
    """mu_w = sum_r r w_r (Theorem 1): the mean age, in sites, at which an error is returned.

    Closed form of the series: sum_r r (1 - b) b^r = b / (1 - b), so
    mu_w = a beta1 / (1 - beta1) + (1 - a) beta2 / (1 - beta2).

    Args:
      config: an `EchoConfig` whose blend/beta1/beta2 are used (default: `EchoConfig()`).
      blend, beta1, beta2: override the config's a, beta1, beta2.

    Returns:
      mu_w as a float.
    """
    a, b1, b2 = _weight_params(config, blend, beta1, beta2)
    return a * b1 / (1 - b1) + (1 - a) * b2 / (1 - b2)


def theorem1_factor(config: Optional[EchoConfig] = None, *, blend: Optional[float] = None,
                    beta1: Optional[float] = None, beta2: Optional[float] = None) -> float:
    """The constant 1 + mu_w of Theorem 1 (Eq. 19): max_t ||S_t|| <= (1 + mu_w) q at eta = 1.

    About 2.095 for the defaults a = 0.35, beta1 = 0.7, beta2 = 0.3 (the paper's "about 2.1").

    Args:
      config: an `EchoConfig` whose blend/beta1/beta2 are used (default: `EchoConfig()`).
      blend, beta1, beta2: override the config's a, beta1, beta2.

    Returns:
      1 + mu_w as a float.
    """
    return 1.0 + mean_age(config, blend=blend, beta1=beta1, beta2=beta2)


def eq21_factor(num_sites: int, config: Optional[EchoConfig] = None, *,
                eta: Optional[float] = None) -> float:
    """The constant of Eq. 21: max_t ||S_t|| <= ((1 - eta) N + eta (1 + mu_w)) q at any gain.

    Args:
      num_sites: N, the number of all-reduces in the pass.
      config: an `EchoConfig` (default: `EchoConfig()`) for eta, blend, beta1, beta2.
      eta: overrides the config's gain.

    Returns:
      (1 - eta) N + eta (1 + mu_w) as a float; equals `theorem1_factor` at eta = 1 and N at 0.
    """
    base = EchoConfig() if config is None else config
    e = base.eta if eta is None else float(eta)
    return (1.0 - e) * num_sites + e * theorem1_factor(base)


# --------------------------------------------------------------------------------------------
# The toy model


@dataclasses.dataclass(frozen=True)
class Mode:
    """One all-reduce mode of the demo.

    Attributes:
      name: row label ("exact" for the reference run).
      kind: "exact" (fp32 psum), "bf16" (psum in bfloat16) or "echo" (`echo_psum`).
      config: the `EchoConfig` of an "echo" mode.
      compensated: thread a `CompensatorState` through the sites (Algorithm 1).
    """

    name: str
    kind: str
    config: Optional[EchoConfig] = None
    compensated: bool = False


def demo_modes(eta: float = 0.75, group_size: int = 128, policy: str = "asym") -> tuple:
    """The reference run followed by the four rows of `MODE_NAMES`.

    The Echo modes use the pure-JAX "xla" transport so they run on fake CPU devices.
    """
    cfg4 = EchoConfig(bits=4, group_size=group_size, policy=policy, eta=eta, transport="xla")
    return (
        Mode("exact", "exact"),
        Mode("16-bit", "bf16"),
        Mode("8-bit", "echo", cfg4.replace(bits=8)),
        Mode("4-bit", "echo", cfg4),
        Mode("4-bit comp", "echo", cfg4, compensated=True),
    )


def init_weights(sites: int, dim: int, hidden: int, seed: int = 0):
    """Random stacked block weights, fixed by `seed`.

    W1 ~ N(0, 1/d) keeps the pre-activation at unit scale after the rmsnorm. W2 ~ N(0, 1/(h N))
    makes every block add about 1/sqrt(N) of the input's scale, so the residual stream stays O(1)
    over the whole stack (its rms grows from 1 to about 1.2) at any depth.

    Args:
      sites: N.
      dim: d, the width of the hidden state.
      hidden: h, the width of each MLP block (split over the ranks).
      seed: seed of the generator.

    Returns:
      (w1 [N, d, h], w2 [N, h, d]) as float32 numpy arrays (`init_hidden` gives z_0).
    """
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((sites, dim, hidden), dtype=np.float32) / np.float32(math.sqrt(dim))
    w2 = rng.standard_normal((sites, hidden, dim), dtype=np.float32)
    w2 *= np.float32(1.0 / math.sqrt(hidden * sites))
    return w1, w2


def init_hidden(tokens: int, dim: int, seed: int = 0) -> np.ndarray:
    """The hidden state entering the first block: N(0, 1) entries, float32 [tokens, d]."""
    rng = np.random.default_rng([seed, 1])
    return rng.standard_normal((tokens, dim), dtype=np.float32)


def block_contribution(z, w1, w2):
    """This rank's partial block output x_{k,i} = gelu(rmsnorm(z) @ W1_i) @ W2_i (Sec. 3.2).

    Args:
      z: hidden state [tokens, d], the same on every rank.
      w1: column shard of W1_k [d, h/P].
      w2: row shard of W2_k [h/P, d].

    Returns:
      fp32 [tokens, d]; the P partial outputs sum to the block output.
    """
    zn = z * lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + _RMS_EPS)
    return jax.nn.gelu(zn @ w1) @ w2


def _norm(v):
    return jnp.sqrt(jnp.sum(jnp.square(v.astype(jnp.float32))))


def _site_step(mode: Mode):
    """The scan body of one mode: carry (z, S, state), one site per step."""
    def step(carry, w):
        z, s_sum, state = carry
        x = block_contribution(z, *w)
        exact = lax.psum(x, AXIS)  # sum_i x_{k,i}: the diagnostic the errors are measured against
        if mode.kind == "exact":
            y, injected = exact, exact
        elif mode.kind == "bf16":
            y = lax.psum(x.astype(jnp.bfloat16), AXIS).astype(jnp.float32)
            injected = exact
        elif not mode.compensated:
            y, injected = echo_psum(x, AXIS, config=mode.config), exact
        else:
            # delta_k = y_k - sum_i x'_{k,i} needs the compensated inputs x' = x + c (Eq. 10),
            # recomputed here from the state before the call with echo_psum's own arithmetic.
            k = comp.Coefficients.from_config(mode.config)
            injected = lax.psum(comp.apply_correction(x, state, k), AXIS)
            y, state = echo_psum(x, AXIS, config=mode.config, state=state)
        rho = y - exact            # Eq. 5: delta_k + C_k (delta_k when uncompensated)
        s_sum = s_sum + rho        # Eq. 6
        return (z + y, s_sum, state), (_norm(rho), _norm(y - injected), _norm(s_sum))

    return step


@functools.lru_cache(maxsize=None)
def _compiled(mode: Mode, mesh: Mesh) -> Callable:
    step = _site_step(mode)

    def stack(z0, w1, w2):
        state = None
        if mode.compensated:
            # Per-rank state (Algorithm 1, reset at the start of the pass), typed as varying so
            # the scan carry keeps one type from site to site.
            zeros = comp.init_state(z0)
            state = comp.CompensatorState(lax.pcast(zeros.m1, AXIS, to="varying"),
                                          lax.pcast(zeros.m2, AXIS, to="varying"))
        carry = (z0, jnp.zeros_like(z0), state)
        (z, _, _), norms = lax.scan(step, carry, (w1, w2))
        return z, norms

    mapped = jax.shard_map(
        stack, mesh=mesh,
        in_specs=(PS(), PS(None, None, AXIS), PS(None, AXIS, None)),
        out_specs=(PS(), (PS(), PS(), PS())))
    return jax.jit(mapped)


def run_stack(mode: Mode, mesh: Mesh, z0, w1, w2):
    """Run the whole stack once under one all-reduce mode.

    Args:
      mode: a `Mode` of `demo_modes`.
      mesh: 1-D mesh with axis "tp" of size P.
      z0, w1, w2: inputs placed on the mesh (see `run_demo`).

    Returns:
      dict of numpy arrays: "z" (final hidden state [tokens, d]), "rho" (||rho_k|| per site),
      "delta" (||delta_k|| per site), "partial_sum" (||S_t|| per site).
    """
    z, (rho, delta, s_norm) = _compiled(mode, mesh)(z0, w1, w2)
    return {"z": np.asarray(z), "rho": np.asarray(rho), "delta": np.asarray(delta),
            "partial_sum": np.asarray(s_norm)}


def summarize(name: str, out: dict, z_exact: np.ndarray) -> dict:
    """One row of the demo from a `run_stack` result.

    Args:
      name: the row label.
      out: `run_stack`'s result for this mode.
      z_exact: final hidden state of the exact run.

    Returns:
      {"mode", "mean_site_error", "max_site_error", "max_injected_error", "max_partial_sum",
      "accumulation_ratio", "final_rel_error"} with plain floats: mean/max_k ||rho_k||,
      max_k ||delta_k|| (q), max_t ||S_t||, max_t ||S_t|| / max_k ||rho_k|| and
      ||z_N - z_N^exact|| / ||z_N^exact||.
    """
    rho = out["rho"].astype(np.float64)
    max_rho = float(rho.max())
    max_s = float(out["partial_sum"].max())
    z = out["z"].astype(np.float64)
    ref = z_exact.astype(np.float64)
    return {
        "mode": name,
        "mean_site_error": float(rho.mean()),
        "max_site_error": max_rho,
        "max_injected_error": float(out["delta"].max()),
        "max_partial_sum": max_s,
        "accumulation_ratio": max_s / max_rho if max_rho > 0 else float("nan"),
        "final_rel_error": float(np.linalg.norm(z - ref) / np.linalg.norm(ref)),
    }


def make_mesh(ranks: int, platform: Optional[str] = "cpu") -> Mesh:
    """A 1-D mesh ("tp",) over the first `ranks` devices of `platform` (None: default backend).

    Raises:
      ValueError: the platform has fewer devices than `ranks`.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    try:
        devices = jax.devices(platform) if platform else jax.devices()
    except RuntimeError as err:
        raise ValueError(f"platform {platform!r} is not available: {err}") from None
    if len(devices) < ranks:
        where = platform or devices[0].platform
        raise ValueError(
            f"the demo needs {ranks} {where} devices for --ranks {ranks}, but only "
            f"{len(devices)} are present. On CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={max(8, ranks)} before JAX "
            "starts (python -m echo_jax demo does this), or pass fewer ranks.")
    # A Mesh of Auto axes: jax.make_mesh's default Explicit axes reject unsharded inputs.
    return Mesh(np.array(devices[:ranks]), (AXIS,))


def run_demo(ranks: int = 4, sites: int = 56, tokens: int = 64, dim: int = 256,
             hidden: Optional[int] = None, seed: int = 0, eta: float = 0.75,
             group_size: int = 128, policy: str = "asym", platform: Optional[str] = "cpu",
             progress: bool = True) -> dict:
    """Run the toy stack under every mode and collect the rows of the demo.

    Args:
      ranks: P, the tensor-parallel group size.
      sites: N, the number of all-reduce sites in the pass.
      tokens: rows of the hidden state.
      dim: d, the width of the hidden state.
      hidden: h, the MLP width (default 4 d); must be a multiple of `ranks`.
      seed: seed of the weights and the input.
      eta: gain of the compensated mode (Eq. 10).
      group_size: quantization group g of the Echo modes.
      policy: quantizer policy of the Echo modes.
      platform: JAX platform of the devices ("cpu" by default, for fake CPU devices).
      progress: show a progress bar over the modes (only if the run takes more than a second).

    Returns:
      {"config": {...}, "rows": [one `summarize` row per name in `MODE_NAMES`]}, ready for
      `json.dump`.
    """
    hidden = 4 * dim if hidden is None else hidden
    for name, v in (("sites", sites), ("tokens", tokens), ("dim", dim), ("hidden", hidden)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if hidden % ranks:
        raise ValueError(f"hidden ({hidden}) must be a multiple of ranks ({ranks}): each rank "
                         "holds an equal shard of the MLP")
    modes = demo_modes(eta=eta, group_size=group_size, policy=policy)
    mesh = make_mesh(ranks, platform)
    w1, w2 = init_weights(sites, dim, hidden, seed)
    z0 = init_hidden(tokens, dim, seed)
    z0 = jax.device_put(z0, NamedSharding(mesh, PS()))
    w1 = jax.device_put(w1, NamedSharding(mesh, PS(None, None, AXIS)))
    w2 = jax.device_put(w2, NamedSharding(mesh, PS(None, AXIS, None)))

    start = time.perf_counter()
    outs = {}
    bar = _progress(modes, enabled=progress)
    for mode in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(mode.name)
        outs[mode.name] = run_stack(mode, mesh, z0, w1, w2)
    elapsed = time.perf_counter() - start

    z_exact = outs["exact"]["z"]
    rows = [summarize(name, outs[name], z_exact) for name in MODE_NAMES]
    cfg = modes[-1].config
    config = {
        "ranks": ranks, "sites": sites, "tokens": tokens, "dim": dim, "hidden": hidden,
        "seed": seed, "platform": mesh.devices.flat[0].platform, "group_size": group_size,
        "policy": policy, "eta": eta, "blend": cfg.blend, "beta1": cfg.beta1, "beta2": cfg.beta2,
        "mean_age": mean_age(cfg), "theorem1_factor": theorem1_factor(cfg),
        "eq21_factor": eq21_factor(sites, cfg), "final_rms": float(np.sqrt(np.mean(
            z_exact.astype(np.float64) ** 2))), "seconds": round(elapsed, 3),
    }
    return {"config": config, "rows": rows}


def _progress(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience; the demo runs without it
        return items
    # delay: no bar at all when the whole demo is quick (e.g. tiny sizes in tests).
    return tqdm(items, desc="modes", unit="mode", delay=1.0, leave=False)


# --------------------------------------------------------------------------------------------
# Output


def format_table(result: dict) -> str:
    """The demo's rows and the Theorem 1 / Eq. 21 reference values as readable text."""
    c = result["config"]
    lines = [
        f"Toy residual stack: N={c['sites']} sites, P={c['ranks']} ranks ({c['platform']}), "
        f"hidden state {c['tokens']}x{c['dim']}, MLP width {c['hidden']}, seed {c['seed']}",
        f"Echo modes: g={c['group_size']}, policy={c['policy']}; compensated with eta={c['eta']}, "
        f"a={c['blend']}, beta1={c['beta1']}, beta2={c['beta2']}",
        "Errors are Frobenius norms over the whole hidden state; rms entry of the exact "
        f"output z_N = {c['final_rms']:.3f}.",
        "  rho_k = y_k - sum_i x_k,i (Eq. 5), delta_k = injected error of the all-reduce "
        "(Eq. 1), S_t = sum_{k<=t} rho_k (Eq. 6)",
        "",
    ]
    head = ("mode", "mean ||rho_k||", "max ||rho_k||", "max ||delta_k||", "max_t ||S_t||",
            "S/rho", "final rel err")
    widths = (11, 15, 14, 16, 14, 7, 14)
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(head, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for row in result["rows"]:
        cells = [row["mode"].ljust(widths[0])]
        for key, w in zip(ROW_KEYS, widths[1:]):
            v = row[key]
            text = f"{v:.2f}" if key == "accumulation_ratio" else f"{v:.3e}"
            cells.append(text.rjust(w))
        lines.append("  ".join(cells))
    rows = {r["mode"]: r for r in result["rows"]}
    lines.append("")
    lines.append(
        f"Theorem 1 (eta=1): max_t ||S_t|| <= (1 + mu_w) q = {c['theorem1_factor']:.3f} q, "
        f"mu_w = {c['mean_age']:.3f}; without compensation up to N q = {c['sites']} q")
    lines.append(
        f"Eq. 21 (eta={c['eta']}): max_t ||S_t|| <= ((1-eta) N + eta (1 + mu_w)) q = "
        f"{c['eq21_factor']:.2f} q")
    for name in ("4-bit", "4-bit comp"):
        r = rows.get(name)
        if r and r["max_injected_error"] > 0:
            lines.append(f"  {name:<10}: max_t ||S_t|| = "
                         f"{r['max_partial_sum'] / r['max_injected_error']:.2f} q  "
                         f"(q = max_k ||delta_k|| = {r['max_injected_error']:.3e})")
    if "4-bit" in rows and "4-bit comp" in rows and rows["4-bit comp"]["max_partial_sum"] > 0:
        lines.append(
            "  compensation shrinks max_t ||S_t|| by "
            f"{rows['4-bit']['max_partial_sum'] / rows['4-bit comp']['max_partial_sum']:.1f}x "
            "and the final error by "
            f"{rows['4-bit']['final_rel_error'] / rows['4-bit comp']['final_rel_error']:.1f}x")
    return "\n".join(lines)


__all__ = [
    "MODE_NAMES", "ROW_KEYS", "Mode", "demo_modes", "compensator_weights", "mean_age",
    "theorem1_factor", "eq21_factor", "init_weights", "init_hidden", "block_contribution",
    "make_mesh", "run_stack", "summarize", "run_demo", "format_table",
]
