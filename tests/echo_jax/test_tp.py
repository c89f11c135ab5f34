"""Megatron TP operators: exact-mode gradients equal the unsharded model's; Echo stays close;
the forward and backward compensator states are threaded and really used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from echo_jax import tp
from conftest import make_mesh, put

D, H, B = 64, 256, 8


def make_params(seed=0, layers=2):
    ks = jax.random.split(jax.random.key(seed), 2 * layers + 1)
    ws = []
    for i in range(layers):
        ws.append(jax.random.normal(ks[2 * i], (D, H)) / 8)
        ws.append(jax.random.normal(ks[2 * i + 1], (H, D)) / 16)
    return tuple(ws), jax.random.normal(ks[-1], (B, D))


def reference_loss(params, x):
    h = x
    for i in range(0, len(params), 2):
        h = h + jax.nn.gelu(h @ params[i]) @ params[i + 1]
    return jnp.sum(jnp.sin(h))


def tp_loss(cfg, choices=None, layer_configs=None):
    """Loss of the 2-layer MLP stack with Megatron f/g sites; also returns the final states.

    layer_configs: a static config per layer instead (no switch), the reference of `choices`."""
    def local(params, x, bs0):
        h, fs, bs = x, ej.init_state(x), bs0
        for layer in range(len(params) // 2):
            c = None if choices is None else jnp.int32(choices[layer])
            lc = cfg if layer_configs is None else layer_configs[layer]
            hin, bs = tp.backward_site(h, "tp", lc, bs, choice=c)            # f
            part = jax.nn.gelu(hin @ params[2 * layer]) @ params[2 * layer + 1]
            y, fs = tp.forward_site(part, "tp", lc, fs, choice=c)             # g
            h = h + y
        return jnp.sum(jnp.sin(h))
    return local


def shard_map_loss(cfg, nranks, choices=None, layers=2, layer_configs=None):
    mesh = make_mesh((nranks,), ("tp",))
    specs = (P(None, "tp"), P("tp", None)) * layers
    return jax.shard_map(tp_loss(cfg, choices, layer_configs), mesh=mesh,
                         in_specs=(specs, P(), P()), out_specs=P())


@pytest.mark.parametrize("nranks", [2, 4])
def test_exact_mode_gradients_equal_unsharded(nranks):
    params, x = make_params()
    f = shard_map_loss(None, nranks)
    bs0 = ej.init_state(x)
    val, (g, gx) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x, bs0)
    ref_val, (ref_g, ref_gx) = jax.value_and_grad(reference_loss, argnums=(0, 1))(params, x)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(ref_gx), rtol=1e-4, atol=1e-5)


# Measured relative errors per weight (4 ranks, seed 1): 0.007-0.008 at 8 bits, 0.12-0.145 at
# 4 bits (the same bits on both transports). The tolerances are about 1.4x those: a quantizer
# with twice the step (0.015-0.018 and 0.26-0.30) fails them.
@pytest.mark.parametrize("bits,tol,transport", [(8, 0.012, "auto"), (4, 0.2, "auto"),
                                                (4, 0.2, "xla")])
def test_echo_gradients_within_tolerance(bits, tol, transport):
    params, x = make_params(1)
    f = shard_map_loss(ej.EchoConfig(bits=bits, transport=transport), 4)
    g = jax.jit(jax.grad(f))(params, x, ej.init_state(x))
    ref = jax.grad(reference_loss)(params, x)
    for a, b in zip(g, ref):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert rel < tol, rel


def test_backward_state_is_threaded_and_used():
    params, x = make_params(2, layers=3)
    cfg = ej.EchoConfig(bits=4)
    f = shard_map_loss(cfg, 4, layers=3)
    bs0 = ej.init_state(x)
    grads = jax.jit(jax.grad(f, argnums=(0, 2)))(params, x, bs0)
    final_bwd_state = grads[1]   # the cotangent of the first site's state input
    assert float(jnp.abs(final_bwd_state.m1).max()) > 0
    assert float(jnp.abs(final_bwd_state.m2).max()) > 0
    # The live state changes the gradients: eta = 0 gives different ones.
    g0 = jax.jit(jax.grad(shard_map_loss(cfg.replace(eta=0.0), 4, layers=3)))(params, x, bs0)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(grads[0], g0))


def test_simulation_with_vmap_matches_shard_map():
    params, x = make_params(3)
    cfg = ej.EchoConfig(bits=4)
    nranks = 4
    sharded = jax.jit(jax.grad(shard_map_loss(cfg, nranks)))(params, x, ej.init_state(x))
    # P simulated ranks on one device: stack per-rank shards and vmap with the axis name.
    per_rank = tuple(
        jnp.stack(jnp.split(w, nranks, axis=1 if i % 2 == 0 else 0)) for i, w in enumerate(params))
    sim = jax.vmap(jax.grad(tp_loss(cfg)), in_axes=(0, None, None), axis_name="tp")
    gs = jax.jit(sim)(per_rank, x, ej.init_state(x))
    for i, (a, b) in enumerate(zip(gs, sharded)):
        full = jnp.concatenate(list(a), axis=1 if i % 2 == 0 else 0)
        np.testing.assert_allclose(np.asarray(full), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_per_layer_bits_choice():
    """A traced per-layer choice runs exactly the chosen config at both sites of each layer:
    loss and gradients equal, bit for bit, those of the same stack with that config written
    statically per layer (no switch), and the swapped choice is the swapped static stack."""
    params, x = make_params(4)
    configs = tp.early_8bit_configs(ej.EchoConfig(bits=4))
    assert configs[0].bits == 8 and configs[1].bits == 4
    assert configs[0].replace(bits=4) == configs[1]
    assert [int(tp.early_8bit_choice(i, 4)) for i in range(4)] == [0, 0, 1, 1]
    assert [int(tp.early_8bit_choice(i, 3)) for i in range(3)] == [0, 0, 1]
    bs0 = ej.init_state(x)

    def run(f):
        val, grads = jax.jit(jax.value_and_grad(f))(params, x, bs0)
        return [np.asarray(val)] + [np.asarray(g) for g in grads]

    def same(a, b):
        return all(np.array_equal(u, v) for u, v in zip(a, b))

    mixed = run(shard_map_loss(configs, 4, choices=(0, 1)))
    swapped = run(shard_map_loss(configs, 4, choices=(1, 0)))
    static_84 = run(shard_map_loss(None, 4, layer_configs=(configs[0], configs[1])))
    static_48 = run(shard_map_loss(None, 4, layer_configs=(configs[1], configs[0])))
    assert same(mixed, static_84), "choices (0, 1) are not 8-bit then 4-bit"
    assert same(swapped, static_48), "choices (1, 0) are not 4-bit then 8-bit"
    # The two orders differ in the forward value and in every gradient.
    assert not np.array_equal(mixed[0], swapped[0])
    assert all(not np.array_equal(u, v) for u, v in zip(mixed[1:], swapped[1:]))
    all_8 = run(shard_map_loss(configs, 4, choices=(0, 0)))
    assert same(all_8, run(shard_map_loss(configs[0], 4)))


def scanned_loss(cfg, nranks, layers):
    """tp_loss as a `lax.scan` over the stacked layers, in a type-checked shard_map (check_vma on):
    the carry (h, forward state, backward state) must keep one type from layer to layer."""
    mesh = make_mesh((nranks,), ("tp",))

    def local(w1, w2, x):
        def layer(carry, xs):
            h, fs, bs = carry
            w_in, w_out, c = xs
            hin, bs = tp.backward_site(h, "tp", cfg, bs, choice=c)           # f
            y, fs = tp.forward_site(jax.nn.gelu(hin @ w_in) @ w_out, "tp", cfg, fs, choice=c)
            return (h + y, fs, bs), None
        # Per-rank compensator states: typed as varying so the carry type is the same at every step.
        zeros = lax.pcast(ej.init_state(x), "tp", to="varying")
        choices = jnp.arange(layers, dtype=jnp.int32) % 2
        (h, _, _), _ = lax.scan(layer, (x, zeros, zeros), (w1, w2, choices))
        return jnp.sum(jnp.sin(h))

    return jax.shard_map(local, mesh=mesh, in_specs=(P(None, None, "tp"), P(None, "tp", None), P()),
                         out_specs=P())


def test_scanned_stack_keeps_carry_types():
    layers = 4
    params, x = make_params(5, layers=layers)
    w1, w2 = jnp.stack(params[0::2]), jnp.stack(params[1::2])
    ref_val, ref_g = jax.value_and_grad(reference_loss, argnums=(0, 1))(params, x)
    ref_w1, ref_w2 = jnp.stack(ref_g[0][0::2]), jnp.stack(ref_g[0][1::2])
    # Exact sites: the scanned TP stack is the unsharded model.
    val, (g1, g2, gx) = jax.jit(jax.value_and_grad(scanned_loss(None, 4, layers), argnums=(0, 1, 2)))(
        w1, w2, x)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for a, b in ((g1, ref_w1), (g2, ref_w2), (gx, ref_g[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # Echo sites, compensated, one of two configs per layer (lax.switch inside the scan body).
    configs = tp.early_8bit_configs(ej.EchoConfig(bits=4))
    g1, g2 = jax.jit(jax.grad(scanned_loss(configs, 4, layers), argnums=(0, 1)))(w1, w2, x)
    for a, b in ((g1, ref_w1), (g2, ref_w2)):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert rel < 0.4, rel


def test_bad_site_arguments():
    with pytest.raises(ValueError, match="EchoConfig"):
        jax.vmap(lambda v: tp.forward_site(v, "tp", {"bits": 4}), axis_name="tp")(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="CompensatorState"):
        jax.vmap(lambda v: tp.backward_site(v, "tp", None, None), axis_name="tp")(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="not bound"):
        tp.forward_site(jnp.ones(4), "tp", None)
