"""``python -m models.experiments error-process``: the error process of one forward pass.

Per site k (the Echo paper Sec. 3.3, Theorem 1): the injected error ||delta_k|| (Eq. 1), the net
error ||rho_k|| = ||delta_k + C_k|| (Eq. 5) and the accumulated error ||S_t|| (Eq. 6),
compensated vs uncompensated, against depth. The values come from the model's own forward pass
through its site tap (`models.model.forward_with_taps`). -> ``results/accuracy_error_process
.json|png``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from echo_jax import compensator as comp
from echo_jax_tools import demo
from models import model as M
from models.cli import place, write_json
from models.config import CommConfig
from models.experiments.helpers import (Variant, announce, describe_comm, echo_config, format_rows,
                                        load_setup, progress_bar, provenance, utc_now)
from models.experiments.plots import plot_error_process

SITE_KEYS = ("delta", "rho", "partial_sum", "block_output", "hidden", "state")


def measure_sites(params, tokens, model_cfg, comm, hook=None, hook_xs=None):
    """One rank's forward pass (the model's own, `models.model.forward_with_taps`) with
    measurements at every forward site.

    Call it inside ``jax.vmap(..., axis_name=comm.axis_name)`` or shard_map, like the model.
    Beside each all-reduce the site tap takes the exact fp32 sum of the contributions, so that at
    site k (two per layer: attention, then MLP):

        delta_k = y_k - sum_i x'_k,i    the error the all-reduce injects (Eq. 1; x' = x + c)
        rho_k   = y_k - sum_i x_k,i     net error, delta_k + C_k (Eq. 5; = delta_k uncompensated)
        S_t     = sum_{k <= t} rho_k    the accumulated error (Eq. 6; the tap's carry)

    All are measured per token, as the L2 norm of one d-dimensional hidden-state vector (the
    norm of the paper's bounds); also the block output sum_i x_k,i, the hidden state after the
    site and this rank's compensator state sqrt(||m1||^2 + ||m2||^2).

    Args:
      params: this rank's parameters (``models.model.param_shapes(model_cfg, P)``).
      tokens: int [B, T].
      model_cfg, comm: the configs (``comm.echo`` None: exact; early 8-bit and site policies
        not supported: x' needs the one config's compensator coefficients).
      hook: optional extra tap, hook(part, y, xs) -> pytree of arrays, called at every site with
        this rank's contribution, the all-reduced sum and the site's slice of `hook_xs`.
      hook_xs: pytree of arrays [2 L, ...] (site k's slice goes to its hook call), or None.

    Returns:
      (logits fp32 [B, T, V], residual stream before the final norm fp32 [B, T, D], a dict of
      fp32 [2 L, B, T] per-token norms keyed by `SITE_KEYS`; with a hook also "hook": its
      outputs stacked [2 L, ...]).
    """
    if comm.early_8bit or comm.site_policy is not None:
        raise ValueError("measure_sites: early_8bit and site policies are not supported")
    axis = comm.axis_name
    f32 = jnp.float32
    b, t = tokens.shape
    e = comm.echo
    compensated = e is not None and e.compensated and comm.compensate_forward
    coef = comp.Coefficients.from_config(e) if compensated else None

    def norm(v):  # per-token L2 norm over the hidden dimension: [B, T]
        return jnp.sqrt(jnp.sum(jnp.square(v.astype(f32)), axis=-1))

    def tap(site, s_sum, xs):
        part, state = site.part, site.state_in
        exact = lax.psum(part.astype(f32), axis)               # sum_i x_k,i, fp32
        if compensated:
            injected = lax.psum(comp.apply_correction(part.astype(f32), state, coef), axis)
        else:
            injected = exact
        y32 = site.y.astype(f32)
        rho = y32 - exact
        s_sum = s_sum + rho
        out = site.state_out
        st = (jnp.sqrt(jnp.square(norm(out.m1)) + jnp.square(norm(out.m2)))
              if compensated else jnp.zeros((b, t), f32))
        stats = dict(zip(SITE_KEYS, (norm(y32 - injected), norm(rho), norm(s_sum), norm(exact),
                                     norm(site.hidden), st)))
        if hook is not None:
            stats["hook"] = hook(part, site.y, xs)
        return s_sum, stats

    s0 = jnp.zeros((b, t, model_cfg.dim), f32)
    run = M.forward_with_taps(params, tokens, model_cfg, comm, tap, tap_carry=s0, tap_xs=hook_xs)
    return run.logits, run.residual.astype(f32), run.taps


def error_process_modes(tp: int, transport: str = "xla") -> list:
    """The rows of the error-process study: exact reference, then 8- and 4-bit with and
    without the compensator, and 4-bit at gain 1 (Theorem 1's setting)."""

    def c(bits, **ch):
        return CommConfig(tp=tp, echo=echo_config(bits, transport, **ch))

    return [
        Variant("exact", "reference", "16-bit (exact)", CommConfig(tp=tp)),
        Variant("8bit-none", "8-bit", "8-bit none", c(8, eta=0.0)),
        Variant("8bit-comp", "8-bit", "8-bit comp (eta 0.75)", c(8)),
        Variant("4bit-none", "4-bit", "4-bit none", c(4, eta=0.0)),
        Variant("4bit-comp", "4-bit", "4-bit comp (eta 0.75)", c(4)),
        Variant("4bit-comp-eta1", "4-bit", "4-bit comp (eta 1, Theorem 1)", c(4, eta=1.0)),
    ]


def measure_error_process(params_stacked, tokens, model_cfg, comm, mesh=None):
    """Run `measure_sites` on all ranks (vmap or shard_map) and summarise it.

    Args:
      params_stacked: per-rank parameters [P, ...].
      tokens: int [B, T].
      model_cfg, comm: the configs.
      mesh: shard_map mesh, or None for the vmap simulation.

    Returns:
      dict of numpy arrays (rank 0's; every rank holds the same sums): "logits" [B, T, V],
      "resid" [B, T, D]; per `SITE_KEYS` key the rms over tokens of the per-token norms [2 L]
      (sqrt(mean_tokens ||v||^2), dominated by the few tokens with the largest activations) and
      "<key>_median" the median over tokens [2 L]; "token_ratio": per token,
      max_t ||S_t|| / max_k ||delta_k|| (the quantity Theorem 1 bounds by (1 + mu_w)) [B * T].
    """

    def fn(params, toks):
        return measure_sites(params, toks, model_cfg, comm)

    run = jax.jit(M.run_per_rank(fn, comm, mesh, stacked_in=(True, False),
                                 stacked_out=(False, False, False)))
    logits, resid, sites = jax.device_get(run(params_stacked, tokens))
    out = {"logits": np.asarray(logits), "resid": np.asarray(resid)}
    for k, v in sites.items():
        v = np.asarray(v, np.float64).reshape(v.shape[0], -1)            # [2 L, tokens]
        out[k] = np.sqrt(np.mean(np.square(v), axis=1))
        out[k + "_median"] = np.median(v, axis=1)
        if k == "delta":
            q_tok = v.max(axis=0)
        if k == "partial_sum":
            s_tok = v.max(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["token_ratio"] = np.where(q_tok > 0, s_tok / np.where(q_tok > 0, q_tok, 1), np.nan)
    return out


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def run_error_process(args) -> dict:
    """Per-site ||delta_k||, ||rho_k||, ||S_t|| along one forward pass. Returns the JSON record."""
    setup = load_setup(args)
    modes = error_process_modes(setup.tp)
    announce(setup, len(modes))

    params = place(M.shard_params(setup.params_full, setup.tp, setup.model_cfg), setup.mesh,
                   CommConfig(tp=setup.tp))
    windows = setup.windows
    inputs, targets = windows[:, :-1], windows[:, 1:]
    n_sites = 2 * setup.model_cfg.n_layers
    results = {}
    bar = progress_bar(modes, desc="modes", unit="mode", disable=args.quiet, leave=False)
    for v in bar:
        t0 = time.perf_counter()
        results[v.key] = measure_error_process(params, inputs, setup.model_cfg, v.comm,
                                               setup.mesh)
        results[v.key]["seconds"] = time.perf_counter() - t0
    ref = results["exact"]
    ref_top = ref["logits"].argmax(-1)
    ref_resid = ref["resid"].astype(np.float64)
    rows, per_site = [], {}
    for v in modes:
        r = results[v.key]
        logp = _log_softmax(r["logits"].astype(np.float64))
        nll = float(-np.take_along_axis(logp, targets[..., None], -1).mean())
        q = float(r["delta"].max())
        smax = float(r["partial_sum"].max())
        e = v.comm.echo
        row = {"mode": v.key, "label": v.label, **describe_comm(v.comm),
               "max_injected_error": q, "mean_injected_error": float(r["delta"].mean()),
               "max_net_error": float(r["rho"].max()), "max_partial_sum": smax,
               "final_partial_sum": float(r["partial_sum"][-1]),
               "partial_sum_over_q": smax / q if q > 0 else None,
               "argmax_site_partial_sum": int(r["partial_sum"].argmax()) + 1,
               # ||S_t|| against the size of the hidden state it sits in (the 16-bit run's).
               "max_relative_partial_sum": float(np.max(r["partial_sum"] / ref["hidden"])),
               "final_resid_rel_error": float(np.linalg.norm(r["resid"] - ref_resid) /
                                              np.linalg.norm(ref_resid)),
               "nll": nll, "perplexity": math.exp(nll),
               "greedy_agreement": float(np.mean(r["logits"].argmax(-1) == ref_top)),
               "seconds": round(r["seconds"], 2)}
        if e is not None and e.compensated:
            row["theorem1_factor"] = demo.theorem1_factor(e)
            row["eq21_factor"] = demo.eq21_factor(n_sites, e)
        elif e is not None:
            row["uncompensated_worst_case_factor"] = n_sites
        ratio = r["token_ratio"][np.isfinite(r["token_ratio"])]
        if ratio.size:
            row.update(token_ratio_median=float(np.median(ratio)),
                       token_ratio_p90=float(np.percentile(ratio, 90)),
                       token_ratio_max=float(ratio.max()))
        rows.append(row)
        per_site[v.key] = {k: [float(x) for x in r[k]] for k in SITE_KEYS}
        per_site[v.key].update({k + "_median": [float(x) for x in r[k + "_median"]]
                                for k in ("delta", "partial_sum", "hidden")})
    record = {**provenance(args, setup),
              "experiment": "error-process", "paper": "the Echo paper Sec. 3.3, Eqs. 1, 5, 6; "
              "Theorem 1 (Eq. 19) and Eq. 21", "created": utc_now(),
              "meta": {**setup.meta, "norm": "per-token L2 norms over the hidden dimension; "
                       "per_site[mode][key] is their rms over tokens (sqrt(mean ||v||^2)), "
                       "[key + '_median'] their median; the max_* row fields use the rms; "
                       "token_ratio_*: per token max_t ||S_t|| / max_k ||delta_k||, median / "
                       "90th percentile / max over tokens",
                       "sites": "k = 1 .. 2L: site 2l-1 is layer l's attention output, 2l its "
                                "MLP output", "n_sites": n_sites},
              "note": args.note, "rows": rows, "per_site": per_site}
    out = Path(args.out_dir) / (f"accuracy_error_process{'_' + args.tag if args.tag else ''}"
                                ".json")
    write_json(out, record)
    png = out.with_suffix(".png")
    plot_error_process(record, png)
    print(format_rows(rows, ("label", "max_injected_error", "max_partial_sum",
                             "partial_sum_over_q", "final_resid_rel_error", "perplexity",
                             "greedy_agreement")))
    print(f"wrote {out} and {png}")
    return record
