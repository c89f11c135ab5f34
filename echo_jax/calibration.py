"""Per-site precision under a wire budget: site-config names, wire costs and the greedy choice.

The Echo paper runs every all-reduce site at one precision; its only remedy for sensitive sites
is the early-site 8-bit policy (Sec. 7.2). A model with several all-reduce sites can instead give
each site its own `EchoConfig` (bits, group size g, quantizer policy, rotation) and spend the
wire bytes where the error hurts. This module holds the model-independent parts:

* `parse_site_config("4g64-h")` and `site_config_label(config)`: short names of site configs,
  ``<bits>g<group size>[-sym|-naive][-h]`` (``-h``: Hadamard rotation) or ``16`` (exact psum);
* `site_wire_bits(config)`: wire bits per element of one site (codes plus the bf16 scale and
  fp16 zero-point spread over the group, Sec. 4; 16 for the exact psum);
* `choose_site_configs(estimates, costs, budget)`: the greedy knapsack that picks one config
  per site under an average budget from per-site estimates of the loss increase.

How the estimates are measured depends on the model: `models.calibrate` measures them for the
Flax transformer of `models/` (the NLL increase of each site and option, or a Fisher proxy).

    import echo_jax as ej
    options = [ej.parse_site_config(s) for s in ("4g128", "4g64", "8g128")]
    costs = [ej.site_wire_bits(c) for c in options]          # [4.25, 4.5, 8.25]
    choice, steps = ej.choose_site_configs(estimates, costs, budget=4.5)
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import numpy as np

from echo_jax import policies
from echo_jax.config import EchoConfig

_NAME = re.compile(r"^(?P<bits>\d+)g(?P<g>\d+)(?P<mods>(?:-(?:sym|naive|asym|h|eta[0-9.]+))*)$")
_POLICY_OF_MOD = policies.BY_LABEL  # "sym" -> "sym", "naive" -> "asym_naive", "asym" -> "asym"


def parse_site_config(name: str, rotation: str = "none", transport: str = "xla"
                      ) -> Optional[EchoConfig]:
    """The site config a short name stands for (compensator at the paper's defaults).

    Args:
      name: ``<bits>g<group size>[-sym|-naive][-h][-eta<x>]``, e.g. "4g128" (4-bit, g = 128,
        zero-aware asym), "4g64-sym", "4g128-h" (Hadamard-rotated groups), "8g128",
        "4g128-eta0" (uncompensated); or "16" / "exact" / "16bit" for the exact psum.
      rotation: the rotation of names without "-h" ("none" or "hadamard").
      transport: the transport of the config ("xla", "p2p" or "auto").

    Returns:
      An EchoConfig, or None for the exact psum.

    Raises:
      ValueError: the name is not of that form, or the config it names is invalid (e.g. an odd
        group size at 4 bits); the message names the value.
    """
    s = str(name).strip().lower()
    if s in ("16", "exact", "16bit"):
        return None
    m = _NAME.match(s)
    if m is None:
        raise ValueError(f"site config {name!r} is not a name; write <bits>g<group size>"
                         "[-sym|-naive][-h], e.g. 4g128, 4g64-sym, 4g128-h, 8g128, or 16")
    mods = [x for x in m.group("mods").split("-") if x]
    policy = "asym"
    for x in mods:
        policy = _POLICY_OF_MOD.get(x, policy)
    fields = {"bits": int(m.group("bits")), "group_size": int(m.group("g")), "policy": policy,
              "transport": transport}
    for x in mods:
        if x.startswith("eta"):
            try:
                fields["eta"] = float(x[3:])
            except ValueError:
                raise ValueError(f"site config {name!r}: {x!r} is not eta<number>") from None
    rot = "hadamard" if "h" in mods else rotation
    if rot != "none":
        fields["rotation"] = rot
    try:
        return EchoConfig(**fields)
    except (ValueError, TypeError) as err:
        raise ValueError(f"site config {name!r}: {err}") from None


def site_config_label(config: Optional[EchoConfig]) -> str:
    """The short name of a site config ("16", "4g128", "4g64-sym", "8g128-h", ...); a
    non-default compensator adds e.g. "-eta0". `parse_site_config` reads it back."""
    if config is None:
        return "16"
    s = f"{config.bits}g{config.group_size}"
    if config.policy != "asym":
        s += "-" + policies.LABELS[config.policy]
    if config.rotation != "none":
        s += "-h" if config.rotation == "hadamard" else f"-{config.rotation}"
    if config.eta != 0.75:
        s += f"-eta{config.eta:g}"
    return s


def site_wire_bits(config: Optional[EchoConfig]) -> float:
    """Nominal wire bits per element of one site: 16 for the exact psum (None), else the codes
    plus the bf16 scale (and fp16 zero-point, asym) of a group over its g values (4.25 for 4-bit
    g = 128 asym, 4.5 for g = 64, 8.25 for 8-bit g = 128); the same as
    `EchoConfig.wire_bits_per_element`. Padding of a tensor to whole groups is not counted."""
    if config is None:
        return 16.0
    return float(policies.wire_bits_per_element(config.bits, config.group_size, config.policy))


def choose_site_configs(estimates, costs, budget: float,
                        start: Optional[Sequence[int]] = None):
    """One option per site under an average wire budget, by a greedy knapsack.

    Every site starts at its cheapest option; then, while the budget allows, the (site, option)
    upgrade with the largest estimated loss reduction per extra wire bit is taken (ties: the
    larger reduction). Estimates are taken as additive over sites.

    Args:
      estimates: [S, O] estimated loss increase of option o at site k (any common offset per
        site; only differences within a row matter). NaN = option not available at that site.
      costs: [O] wire bits per element of each option (`site_wire_bits`).
      budget: the average wire bits per element over the S sites.
      start: the starting option per site (default: the cheapest option; among equally cheap
        ones, the one with the lowest estimate).

    Returns:
      (choice, steps): choice is a list of S option indices whose average cost is at most
      `budget`; steps lists the upgrades taken, each {"site", "from", "to", "gain",
      "extra_bits", "average_bits"}.

    Raises:
      ValueError: shapes do not match, or the budget is below the cheapest option (or below
        the cost of `start`).
    """
    est = np.asarray(estimates, np.float64)
    costs = np.asarray(costs, np.float64)
    if est.ndim != 2 or costs.shape != (est.shape[1],):
        raise ValueError(f"choose_site_configs: estimates must be [sites, options] and costs "
                         f"[options]; got shapes {est.shape} and {costs.shape}")
    n_sites, n_opt = est.shape
    tol = 1e-9
    cheapest = float(costs.min())
    if cheapest > budget + tol:
        raise ValueError(f"choose_site_configs: budget {budget:g} bits per element is below "
                         f"the cheapest option ({cheapest:g})")
    if start is None:
        low = [o for o in range(n_opt) if costs[o] <= cheapest + tol]
        start = [min((est[k, o] if np.isfinite(est[k, o]) else np.inf, o) for o in low)[1]
                 for k in range(n_sites)]
    choice = [int(c) for c in start]
    if len(choice) != n_sites:
        raise ValueError(f"choose_site_configs: start has {len(choice)} entries for "
                         f"{n_sites} sites")
    total = float(sum(costs[c] for c in choice))
    limit = budget * n_sites
    if total > limit + tol:
        raise ValueError(f"choose_site_configs: the starting choice costs "
                         f"{total / n_sites:g} bits per element, above the budget {budget:g}")
    steps = []
    while True:
        best = None
        for k in range(n_sites):
            a = choice[k]
            for o in range(n_opt):
                extra = costs[o] - costs[a]
                if o == a or extra < -tol or total + extra > limit + tol:
                    continue
                if not np.isfinite(est[k, o]):
                    continue
                gain = est[k, a] - est[k, o]
                if not gain > 0:
                    continue
                key = (math.inf if extra <= tol else gain / extra, gain)
                if best is None or key > best[0]:
                    best = (key, k, o, extra, gain)
        if best is None:
            return choice, steps
        _, k, o, extra, gain = best
        steps.append({"site": k, "from": choice[k], "to": o, "gain": float(gain),
                      "extra_bits": float(extra)})
        choice[k] = o
        total += extra
        steps[-1]["average_bits"] = total / n_sites
