"""Echo in a model we did not write: RecurrentGemma (PyPI `recurrentgemma`), unchanged.

The package's Griffin runs tensor-parallel on 8 fake CPU devices with its projections routed
through echo_jax's GSPMD sites (`models.external.recurrentgemma_tp`). Exact mode is checked
against the unmodified model (unsharded, the same parameters); 4-bit Echo against exact; the CLI
for a few steps. Skipped where the package is not installed.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from echo_jax_tools.provenance import device_name

pytest.importorskip("recurrentgemma.jax")

from models.external import recurrentgemma_tp as R  # noqa: E402

B, T = 4, 32                # batch rows (split over "data" where dp = 2), sequence length


@pytest.fixture(scope="module")
def setup():
    """A small Griffin (recurrent, recurrent, attention), its package init, a batch of bytes,
    and the unmodified model's loss and gradients on one device."""
    model = R.make_model(R.small_config(width=64, layers=3, num_heads=4, window=T))
    params = R.init_params(model, jax.random.key(0), (B, T))
    text = np.frombuffer(b"Now is the winter of our discontent made glorious summer. " * 4,
                         dtype=np.uint8)
    batch = jnp.asarray(np.stack([text[i * 7:i * 7 + T + 1] for i in range(B)]), jnp.int32)
    value_and_grad = jax.jit(jax.value_and_grad(
        functools.partial(R.loss_fn, model=model, sites=None)))
    loss, grads = value_and_grad(params, batch)
    return model, params, batch, float(loss), grads


def _rel(a, b):
    """The relative (norm) error of a against b, the worst leaf."""
    return max(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_param_specs_are_megatrons(setup):
    _, params, *_ = setup
    specs = R.param_specs(params)
    attn, rec, mlp = (specs["blocks.2"]["attention_block"], specs["blocks.0"]["recurrent_block"],
                      specs["blocks.0"]["mlp_block"])
    assert attn["proj_q"]["kernel"] == jax.P(None, "tp")             # column: output split
    assert attn["proj_final"]["kernel"] == jax.P("tp", None)         # row: input split
    assert attn["proj_k"]["kernel"] == jax.P()                       # one key head: replicated
    assert rec["linear_x"]["bias"] == jax.P("tp") and rec["linear_out"]["bias"] == jax.P()
    assert rec["rg_lru"]["a_gate"]["w"] == jax.P("tp", None, None)   # one gate block a head
    assert mlp["ffw_up"]["w"] == jax.P(None, None, "tp")
    assert specs["embedder"]["input_embedding"] == jax.P()
    with pytest.raises(ValueError, match="tp=3 must divide"):
        R.check_divisible(R.small_config(width=64, num_heads=4), 3)


@pytest.mark.grid("tp4")                   # dp2xtp4 runs with the slow set (`-m slow`)
@pytest.mark.parametrize("dp,tp", [pytest.param(1, 4, id="tp4"), pytest.param(2, 4, id="dp2xtp4")])
def test_exact_mode_matches_the_unmodified_model(setup, dp, tp):
    # Exact mode (config=None: lax.psum at every site) against the package's model as it ships,
    # unsharded, with the same parameters. Not bit for bit: the sites contract each rank's block
    # (other dot shapes, which XLA:CPU's kernels round differently) and the all-reduce adds the P
    # partial sums in rank order, not one dot's order; with dp = 2 the mean over the batch is
    # also split over the data shards. So the loss and gradients agree to fp32 rounding.
    model, params, batch, loss_ref, grads_ref = setup
    mesh = R.make_mesh(dp, tp)
    with jax.set_mesh(mesh):
        sharded = R.shard_params(params, mesh)
        value_and_grad = jax.jit(jax.value_and_grad(functools.partial(
            R.loss_fn, model=model, sites=R.EchoSites(None, False, tp))))
        loss, grads = value_and_grad(sharded, batch)
    assert float(loss) == pytest.approx(loss_ref, rel=1e-6, abs=0)
    assert _rel(grads, grads_ref) < 1e-5
    assert grads["blocks.0"]["recurrent_block"]["linear_x"]["kernel"].sharding.spec == \
        jax.P(None, "tp")                                            # the gradients stay sharded


def test_cli_trains_every_mode_a_few_steps(tmp_path, capsys):
    # Three steps per mode on dp x tp = 2 x 4, from the same init and batches: the 4-bit
    # compensated loss is close to exact at step 1 (the init) and after one update, and differs
    # from it (Echo ran); the JSON, the table and the plot are written.
    text = tmp_path / "text.txt"
    text.write_text("Shall I compare thee to a summer's day? Thou art more lovely. " * 40)
    out = tmp_path / "out"
    argv = ["--steps", "3", "--dp", "2", "--tp", "4", "--modes", "exact", "echo4",
            "--width", "64", "--layers", "3", "--batch-size", "4", "--seq-len", "32",
            "--warmup", "1", "--eval-windows", "0", "--text", str(text), "--out", str(out),
            "--quiet"]
    assert R.main(argv) == 0
    record = json.loads((out / "recurrentgemma_tp.json").read_text())
    assert record["command"] == "python -m models.external.recurrentgemma_tp " + " ".join(argv)
    assert record["commit"] and record["device"] == device_name(jax.devices()[:8])
    exact, echo = record["runs"]
    assert [r["mode"] for r in record["runs"]] == ["exact", "echo4"]
    assert len(exact["losses"]) == len(echo["losses"]) == 3
    assert all(np.isfinite(exact["losses"] + echo["losses"]))
    for step in (0, 1):
        assert echo["losses"][step] == pytest.approx(exact["losses"][step], rel=0.02)
    assert echo["losses"] != exact["losses"]
    assert (out / "recurrentgemma_tp.png").stat().st_size > 0
    table = (out / "recurrentgemma_tp.md").read_text()
    assert "Echo 4-bit, compensated" in table and "| step 3 |" in table
    assert "Echo 4-bit, compensated" in capsys.readouterr().out
