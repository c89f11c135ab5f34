"""Generate text from a checkpoint with the KV cache: ``python -m models.generate``.

    python -m models.generate --checkpoint smollm2 --tp 3 --bits 4 \\
        --prompt "The capital of France is" --max-new-tokens 32

The prompt is run through the P-rank model once (``models.model.prefill``), then one token per
step (``decode_step``), every all-reduce exact (``--bits 16``) or Echo. Decoding is greedy unless
``--temperature`` > 0 (then softmax sampling, optionally restricted to the ``--top-k`` most likely
tokens, reproducible with ``--seed``). It stops after ``--max-new-tokens`` or at the end-of-
sequence token. The continuation is printed on stdout; ``--json`` also writes the ids and timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import numpy as np

from models import model as M
from models.checkpoints import load_model
from models.cli import (add_comm_args, add_model_args, comm_from_args, comm_to_dict,
                        ensure_host_devices, make_mesh, place, recorded_command, run_provenance,
                        write_json)
from models.config import check_comm

# SmolLM2-Instruct's chat template (its default system prompt when none is given).
CHAT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_prompt(user: str, system: str = CHAT_SYSTEM) -> str:
    """The ChatML text of one user turn, ending where the assistant's answer starts."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def sample_next(logits, temperature: float, top_k: int, rng) -> int:
    """Pick the next token from logits [V].

    Args:
      logits: fp32 numpy [V].
      temperature: 0 = greedy (argmax), else softmax(logits / temperature) sampling.
      top_k: sample among the k most likely tokens only (0 = all).
      rng: a numpy Generator (used only when sampling).

    Returns:
      The token id.
    """
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


def generate(params_stacked, prompt_ids, model_cfg, comm, mesh, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0, stop_ids=()) -> dict:
    """Prefill the prompt, then decode token by token with the KV cache.

    Args:
      params_stacked: per-rank parameters [P, ...] (placed).
      prompt_ids: list of prompt token ids (at least one).
      model_cfg, comm, mesh: the model, the communication, shard_map mesh or None (vmap).
      max_new_tokens: the most tokens to generate.
      temperature, top_k, seed: sampling (temperature 0 = greedy).
      stop_ids: ids that end the generation (kept in the output).

    Returns:
      {"ids": generated ids, "prefill_s", "decode_s", "stopped": bool}.
    """
    n = len(prompt_ids)
    capacity = n + max_new_tokens
    if capacity > model_cfg.max_seq_len:
        raise ValueError(f"prompt ({n} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                         f"model's max_seq_len {model_cfg.max_seq_len}")
    rng = np.random.default_rng(seed)
    cache = M.init_cache(model_cfg, comm, batch_size=1, max_len=capacity)
    if mesh is not None:
        cache = M.place_params(cache, mesh, comm)
    t0 = time.perf_counter()
    logits, cache = M.prefill(params_stacked, np.asarray([prompt_ids], np.int32), cache,
                              model_cfg, comm, mesh)
    last = np.asarray(jax.device_get(logits[0, -1]))
    prefill_s = time.perf_counter() - t0
    ids, stopped = [], False
    t1 = time.perf_counter()
    for i in range(max_new_tokens):
        tok = sample_next(last, temperature, top_k, rng)
        ids.append(tok)
        if tok in stop_ids:
            stopped = True
            break
        if i + 1 == max_new_tokens:
            break
        logits, cache = M.decode_step(params_stacked, np.asarray([tok], np.int32), cache,
                                      model_cfg, comm, mesh)
        last = np.asarray(jax.device_get(logits[0]))
    return {"ids": ids, "prefill_s": prefill_s, "decode_s": time.perf_counter() - t1,
            "stopped": stopped}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m models.generate`."""
    ap = argparse.ArgumentParser(
        prog="python -m models.generate",
        description="Continue a prompt with a checkpoint on P tensor-parallel ranks (exact or "
                    "Echo all-reduces), with the KV cache. Greedy unless --temperature > 0.")
    add_model_args(ap)
    add_comm_args(ap)
    g = ap.add_argument_group("generation")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a file")
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="the most tokens to generate. Default 64.")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) = greedy decoding")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens only (0 = all). Default 0.")
    g.add_argument("--seed", type=int, default=0, help="sampling seed. Default 0.")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the ChatML template of SmolLM2-Instruct (system + "
                        "user turn, then the assistant's turn)")
    g.add_argument("--system", default=CHAT_SYSTEM,
                   help="system message of --chat (default: SmolLM2's)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence / document separator token")
    ap.add_argument("--json", metavar="OUT",
                    help="write prompt, continuation, ids, config and timing as JSON")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `python -m models.generate`.

    Args:
      argv: the arguments (default sys.argv[1:]).

    Returns:
      The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.command = recorded_command("models.generate", argv)
    if args.tp <= 0 or args.max_new_tokens <= 0:
        ap.error("--tp and --max-new-tokens must be positive")
    if args.temperature < 0 or args.top_k < 0:
        ap.error("--temperature and --top-k must be >= 0")
    ensure_host_devices(args.tp)
    try:
        result = _run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _run(args) -> dict:
    """Load, generate, print; returns the JSON record of main()."""
    comm = comm_from_args(args)
    lm = load_model(args.checkpoint, dtype=args.dtype, step=args.step, tokenizer=args.tokenizer,
                    cache_dir=args.cache_dir)
    cfg, tok = lm.model_cfg, lm.tokenizer
    check_comm(cfg, comm)
    text = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    if args.chat:
        text = chat_prompt(text, args.system)
    prompt_ids = tok.encode(text, allow_special=args.chat)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    mesh, mode = make_mesh(comm, args.simulate)
    params = place(M.shard_params(lm.params, comm.tp, cfg), mesh, comm)
    stop = () if args.ignore_eos else tuple({i for i in (tok.eos_id, tok.eot_id)
                                             if i is not None})
    print(f"model: {cfg.name}; {comm.describe()}; {mode}; prompt {len(prompt_ids)} tokens",
          file=sys.stderr, flush=True)
    out = generate(params, prompt_ids, cfg, comm, mesh, args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                   stop_ids=stop)
    ids = out["ids"]
    shown = ids[:-1] if out["stopped"] else ids  # the stop token is not part of the text
    completion = tok.decode(shown)
    print(completion, flush=True)
    n = len(ids)
    print(f"[{n} tokens; prefill {out['prefill_s']:.2f} s, decode {out['decode_s']:.2f} s "
          f"({n / max(out['decode_s'], 1e-9):.1f} tok/s incl. compilation)"
          f"{'; stopped at end-of-sequence' if out['stopped'] else ''}]", file=sys.stderr)
    return {**run_provenance(getattr(args, "command", None), mesh),
            "prompt": text, "prompt_ids": prompt_ids, "completion": completion,
            "completion_ids": ids, "stopped_at_eos": out["stopped"],
            "config": {**lm.info, "model": dataclasses.asdict(cfg), "comm": comm_to_dict(comm),
                       "mode": mode, "temperature": args.temperature, "top_k": args.top_k,
                       "seed": args.seed, "chat": args.chat, "tokenizer": tok.name},
            "time_s": {"prefill": out["prefill_s"], "decode": out["decode_s"]}}


if __name__ == "__main__":
    sys.exit(main())
