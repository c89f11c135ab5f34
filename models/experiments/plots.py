"""The PNG figures of the accuracy studies, one function per study (pretrain-table draws with
``models.train.plot_runs``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.experiments.helpers import BEYOND_BUDGET, BEYOND_TARGET_PCT, pyplot


def save_figure(plt, fig, out: Path, dpi: int) -> None:
    """Lay out `fig`, write it to `out` (creating its folder) and close it.

    Args:
      plt: matplotlib.pyplot (`helpers.pyplot()`).
      fig: the figure.
      out: the PNG path.
      dpi: resolution.
    """
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def plot_inference(record: dict, out: Path) -> None:
    """Bar chart of the perplexity increase over 16-bit and of the greedy agreement."""
    plt = pyplot()
    rows = [r for r in record["rows"] if r["bits"] != 16]
    labels = [r["label"].split(" (")[0] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8))
    y = np.arange(len(rows))
    axes[0].barh(y, [r.get("delta_ppl_vs_16bit", np.nan) for r in rows], color="C0")
    axes[0].set_xlabel("perplexity - 16-bit perplexity")
    axes[1].barh(y, [100 * r.get("greedy_agreement", np.nan) for r in rows], color="C1")
    axes[1].set_xlabel("greedy agreement with 16-bit (%)")
    for ax, fmt in zip(axes, ("{:+.3g}", "{:.1f} %")):
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
        for bar in ax.patches:  # the numbers on the bars: 8-bit bars are too short to see
            w = bar.get_width()
            if w == w:
                ax.text(w, bar.get_y() + bar.get_height() / 2, " " + fmt.format(w),
                        va="center", fontsize=8)
        ax.margins(x=0.15)
    axes[1].set_yticklabels([])
    m = record["meta"]
    ref = next((r["perplexity"] for r in record["rows"] if r["bits"] == 16), float("nan"))
    fig.suptitle(f"{m['model']['name']} at P={m['tp']} ({m['forward_sites']} forward sites), "
                 f"{m['tokens_scored']} tokens; 16-bit perplexity {ref:.3f}", fontsize=10)
    save_figure(plt, fig, out, dpi=120)


def plot_ablations(record: dict, out: Path) -> None:
    """One panel per bit width: each variant's perplexity minus the full method's."""
    plt = pyplot()
    bits = sorted({r["bits"] for r in record["rows"] if r["bits"] != 16}, reverse=True)
    if not bits:
        return
    n = max(sum(1 for r in record["rows"] if r["bits"] == b and "same_run_as" not in r)
            for b in bits)
    fig, axes = plt.subplots(1, len(bits), figsize=(6.5 * len(bits), 0.4 * n + 1.8),
                             squeeze=False)
    for ax, b in zip(axes[0], bits):
        rows = [r for r in record["rows"] if r["bits"] == b and "same_run_as" not in r]
        y = np.arange(len(rows))
        d = [r.get("delta_ppl_vs_full", np.nan) for r in rows]
        ax.barh(y, d, color=["C2" if r["key"] == "full" else "C0" for r in rows])
        ax.set_yticks(y, [f"{r['variant'].split(' (')[0]}  [{r['perplexity']:.3f}]"
                          for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.axvline(0, color="k", lw=0.8)
        ax.grid(alpha=0.3, axis="x")
        full = next((r["perplexity"] for r in rows if r["key"] == "full"), float("nan"))
        ax.set_title(f"{b}-bit (full method: perplexity {full:.3f})", fontsize=10)
        ax.set_xlabel("perplexity - full method's")
        mags = sorted(abs(x) for x in d if x == x and x != 0)
        if mags and mags[-1] > 50 * mags[len(mags) // 2]:
            # A few rows (no compensator, naive asym) dwarf the coefficient sweeps: symlog
            # keeps both readable.
            ax.set_xscale("symlog", linthresh=mags[len(mags) // 2])
    m = record["meta"]
    fig.suptitle(f"Ablations, {m['model']['name']} at P={m['tp']}, {m['tokens_scored']} tokens",
                 fontsize=10)
    save_figure(plt, fig, out, dpi=120)


def plot_error_process(record: dict, out: Path) -> None:
    """||delta_k||, ||S_t|| and ||S_t|| / ||z_t|| per site, one line per mode, log scale.

    Left column: the rms over tokens of the per-token norms (dominated by the few tokens that
    carry the model's largest activations); right column: the median token.
    """
    plt = pyplot()
    ps = record["per_site"]
    n = record["meta"]["n_sites"]
    k = np.arange(1, n + 1)
    styles = {"8bit-none": ("C7", ":"), "8bit-comp": ("C7", "-"), "4bit-none": ("C3", "--"),
              "4bit-comp": ("C0", "-"), "4bit-comp-eta1": ("C2", "-.")}
    labels = {r["mode"]: r["label"] for r in record["rows"]}
    fig, axes = plt.subplots(3, 2, figsize=(14, 11), sharex=True)
    for col, (suffix, what) in enumerate((("", "rms over tokens"), ("_median", "median token"))):
        ax = axes[:, col]
        if "exact" in ps:
            if suffix == "":
                ax[0].plot(k, ps["exact"]["block_output"], color="k", alpha=0.3, lw=1,
                           label="block output ||sum_i x_k,i|| (16-bit run)")
            ax[1].plot(k, ps["exact"]["hidden" + suffix], color="k", alpha=0.3, lw=1,
                       label="hidden state ||z_k|| (16-bit run)")
        for mode, (color, ls) in styles.items():
            if mode not in ps:
                continue
            s_t = np.asarray(ps[mode]["partial_sum" + suffix])
            ax[0].plot(k, ps[mode]["delta" + suffix], color=color, ls=ls, lw=1.3,
                       label=labels[mode])
            ax[1].plot(k, s_t, color=color, ls=ls, lw=1.5, label=labels[mode])
            if "exact" in ps:
                ax[2].plot(k, s_t / np.asarray(ps["exact"]["hidden" + suffix]), color=color,
                           ls=ls, lw=1.5, label=labels[mode])
        for a in ax:
            a.set_yscale("log")
            a.grid(alpha=0.3, which="both")
        ax[0].set_title(what, fontsize=10)
        ax[0].set_ylabel("injected error ||delta_k||")
        ax[1].set_ylabel("accumulated error ||S_t||")
        ax[2].set_ylabel("||S_t|| / ||z_t|| (16-bit run)")
        ax[2].set_xlabel("site k (2 per layer: attention, MLP)")
    axes[0, 0].legend(fontsize=7, ncol=2)
    axes[1, 1].legend(fontsize=7, ncol=2)
    m = record["meta"]
    fig.suptitle(f"Error process of one forward pass: {m['model']['name']}, P={m['tp']}, "
                 f"{m['tokens_scored']} tokens (per-token L2 norms)", fontsize=11)
    save_figure(plt, fig, out, dpi=110)


def plot_beyond(record: dict, out: Path) -> None:
    """Pareto plot: wire bits per element against the perplexity increase over 16-bit (%)."""
    plt = pyplot()
    rows = [r for r in record["rows"] if r["key"] != "16bit"]
    used = set()  # the point colours drawn, for the legend
    fig, ax = plt.subplots(figsize=(9, 6))
    if rows:
        xs = np.array([r["wire_bits_per_element"] for r in rows])
        ys = np.array([r["rel_delta_ppl_vs_16bit_pct"] for r in rows])
        colors = {"calibrated": "C3", "mixed": "C1", "policy file": "C4"}
        for r, x, y in zip(rows, xs, ys):
            c = colors.get(r["group"], "C2" if "rotated" in r["group"] else "C0")
            used.add(c)
            ax.scatter([x], [y], color=c, s=40, zorder=3,
                       edgecolor="k" if r.get("pareto") else "none")
            ax.annotate(r["key"], (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
        front = [r for r in rows if r.get("pareto")]
        front.sort(key=lambda r: r["wire_bits_per_element"])
        if front:
            ax.plot([r["wire_bits_per_element"] for r in front],
                    [r["rel_delta_ppl_vs_16bit_pct"] for r in front], color="k", lw=1,
                    ls="--", label="Pareto front", zorder=2)
        pos = np.abs(ys[ys != 0])
        lin = float(max(min(pos.min(), 1.0), 1e-3)) if pos.size else 1.0
        ax.set_yscale("symlog", linthresh=lin)
    goal = record.get("goal", {})
    ax.axhline(goal.get("target_rel_delta_pct", BEYOND_TARGET_PCT), color="C3", lw=0.8,
               label=f"goal +{goal.get('target_rel_delta_pct', BEYOND_TARGET_PCT):g} %")
    ax.axvline(goal.get("budget_bits", BEYOND_BUDGET), color="C3", lw=0.8, ls=":",
               label=f"budget {goal.get('budget_bits', BEYOND_BUDGET):g} bits")
    ax.axhline(0, color="k", lw=0.5)
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], marker="o", ls="", color=c, label=lab) for c, lab in
                (("C0", "uniform"), ("C2", "uniform + hadamard"), ("C1", "early 8-bit"),
                 ("C3", "calibrated per-site"), ("C4", "policy file")) if c in used]
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    ax.set_xlabel("wire bits per element (codes + scale / zero-point, mean over forward sites)")
    ax.set_ylabel("perplexity increase over 16-bit (%)")
    ax.grid(alpha=0.3, which="both")
    m = record["meta"]
    ref = next((r["perplexity"] for r in record["rows"] if r["key"] == "16bit"), float("nan"))
    ax.set_title(f"{m['model']['name']} at P={m['tp']}, {m['tokens_scored']} held-out tokens; "
                 f"16-bit perplexity {ref:.3f}", fontsize=10)
    save_figure(plt, fig, out, dpi=120)
