"""In-memory mutants of echo_jax and models, and the tests of the suite that must kill each one.

Loaded as a pytest plugin (``-p mutants``, with tests/ on sys.path) by tests/test_mutants.py:
with ``ECHO_JAX_MUTANT=<name>`` in the environment it rewrites one function of the library in
memory before any test runs (the source text of the function with one change, compiled into its
own module), so the named tests run against a broken implementation. Nothing in the tree
changes, and without the variable the plugin does nothing. A mutant of the C++ CPU handler
(`_native_mutant`) compiles the handler's source with one change into a library in the temporary
directory and registers its handlers in place of echo_jax._ffi's.

Each entry of `MUTANTS` is (what the mutant breaks, how it is applied, the node ids of the tests
that must fail on it). The killers are the tests that check the claim against an independent
reference (NumPy float64 quantities, an analytic or unsharded gradient, a replay of Algorithm 1),
not against another output of the code under test.
"""

from __future__ import annotations

import __future__
import inspect
import os
import sys
import textwrap

ENV = "ECHO_JAX_MUTANT"


def _replace_everywhere(old, new):
    """Rebind every module-level name bound to `old` (re-exports included) to `new`."""
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "") or ""
        if not (name.startswith("echo_jax") or name.startswith("models")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, attr, new)


def mutate(module, name, *edits, owner=None):
    """Recompile `module.name` (or `owner.name`, a method) with each (old, new) edit applied.

    The source must contain every `old` exactly once. Decorators are part of the recompiled
    source, so a rule registered by a decorator (``@f.defjvp``) is registered again, mutated.
    Returns the new object.
    """
    holder = module if owner is None else owner
    obj = inspect.getattr_static(holder, name)
    func = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
    src = textwrap.dedent(inspect.getsource(func))
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"mutant of {module.__name__}.{name}: expected one occurrence "
                               f"of {old!r}, found {src.count(old)}")
        src = src.replace(old, new)
    if owner is not None and isinstance(obj, classmethod) and not src.lstrip().startswith("@"):
        src = "@classmethod\n" + src
    namespace = {}
    code = compile(src, f"<mutant of {module.__name__}.{name}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, vars(module), namespace)  # noqa: S102 - the point of a mutant
    mutated = namespace[name]
    if owner is not None:
        setattr(owner, name, mutated)
    else:
        _replace_everywhere(obj, mutated)
        setattr(module, name, mutated)
    return mutated


# --------------------------------------------------------------------------------------------
# The mutants


def _doubled_scale():
    from echo_jax import quant
    mutate(quant, "quantize_groups",
           ("bf16_round_up(s_raw)", "bf16_round_up(2 * s_raw)"),
           ("bf16_round_up(jnp.maximum(amax * np.float32(1.0 / qmax), floor))",
            "bf16_round_up(2 * jnp.maximum(amax * np.float32(1.0 / qmax), floor))"))


def _scale_rounded_down():
    from echo_jax import quant
    mutate(quant, "bf16_round_up",
           ("out = (bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)",
            "out = bits & np.uint32(0xFFFF0000)"))


def _scale_rounded_to_nearest():
    from echo_jax import quant
    mutate(quant, "quantize_groups",
           ("bf16_round_up(s_raw)", "bf16_round(s_raw)"),
           ("bf16_round_up(jnp.maximum(amax * np.float32(1.0 / qmax), floor))",
            "bf16_round(jnp.maximum(amax * np.float32(1.0 / qmax), floor))"))


def _range_limit_inclusive():
    from echo_jax import quant
    mutate(quant, "quantize_groups",
           ("ok = finite & (amax < np.float32(RANGE_LIMIT))",
            "ok = finite & (amax <= np.float32(RANGE_LIMIT))"))


def _range_limit_dropped():
    from echo_jax import quant
    mutate(quant, "quantize_groups", ("ok = finite & (amax < np.float32(RANGE_LIMIT))",
                                      "ok = finite"))


def _scale_floor_raised():
    from echo_jax import quant
    mutate(quant, "quantize_groups",
           ("floor = np.float32(SCALE_FLOOR)", "floor = np.float32(2.0 ** -90)"))


def _naive_zero_point():
    from echo_jax import quant
    mutate(quant, "quantize_groups",
           ("jnp.where((lo < 0) & (hi > 0), jnp.round(zn), zn)", "zn"))


def _own_segment_quantized():
    from echo_jax.transports import xla
    mutate(xla, "_push_and_reduce",
           ("lax.dynamic_index_in_dim(segs, me, 0, keepdims=False)",
            "lax.dynamic_index_in_dim(copies, me, 0, keepdims=False)"))


def _local_residual_push_error_on_own_segment():
    from echo_jax.transports import xla
    mutate(xla, "xla_allreduce_local",
           ("err = jnp.where(ranks == me, (acc - own_y)[None], segs - sent)",
            "err = segs - sent"))


def _wrong_beta():
    from echo_jax import compensator
    mutate(compensator, "from_config",
           ("f(config.beta1), f(1.0 - config.beta1)", "f(config.beta2), f(1.0 - config.beta1)"),
           owner=compensator.Coefficients)


def _int8_scale_a_power_coarser():
    from echo_jax import compensator
    mutate(compensator, "state_scale",
           ("jnp.where(fits, exponent - k, exponent - (k - 1))",
            "jnp.where(fits, exponent - (k - 1), exponent - (k - 1))"))


def _straight_through_3t():
    from echo_jax import collective
    mutate(collective, "_allreduce_f32_jvp", ("lax.psum(t, axis)", "3 * t"))


def _straight_through_fused():
    from echo_jax import collective
    mutate(collective, "_fused_allreduce_f32_jvp",
           ("lax.psum(t, axis).astype(y.dtype)", "t.astype(y.dtype)"))


def _mutate_backward_site(old, new):
    """Mutates the backward TP site's cotangent rule (one replacement) and re-registers it."""
    from echo_jax import tp
    bwd = mutate(tp, "_backward_site_bwd", (old, new))
    tp._backward_site.defvjp(tp._backward_site_fwd, bwd)


def _swapped_backward_choice():
    _mutate_backward_site(
        "site_all_reduce(ct_x, axis, config, choice,",
        "site_all_reduce(ct_x, axis, config, None if choice is None else 1 - choice,")


def _pytree_later_leaves_uncompensated():
    from echo_jax import collective
    mutate(collective, "echo_psum",
           ("pairs = [_echo_leaf(leaf, s, axis, config, rescale) for leaf, s in zip(leaves, "
            "states)]",
            "pairs = [_echo_leaf(leaf, s, axis, config, rescale) if i == 0 else "
            "(_echo_leaf(leaf, None, axis, config, rescale)[0], s) "
            "for i, (leaf, s) in enumerate(zip(leaves, states))]"))


def _demo_delta_uncorrected():
    from echo_jax_tools import demo
    mutate(demo, "_site_step",
           ("injected = lax.psum(comp.apply_correction(x, state, k), AXIS)", "injected = exact"))


def _experiments_delta_uncorrected():
    from models.experiments import error_process
    mutate(error_process, "measure_sites",
           ("injected = lax.psum(comp.apply_correction(part.astype(f32), state, coef), axis)",
            "injected = exact"))


def _cli_rotation_not_applied():
    from models import config
    mutate(config, "_site_configs",
           ("cfg = self.echo if compensate else self.echo.replace(eta=0.0)",
            "cfg = (self.echo if compensate else self.echo.replace(eta=0.0)).replace("
            "rotation='none')"), owner=config.CommConfig)


def _bench_identity_vacuous():
    from echo_jax_tools import bench
    mutate(bench, "_compare", ("jnp.all(bits == bits[:1])", "jnp.all(bits == bits)"))


def _p2p_transient_ulp():
    """The custom call returns one element 1 ulp off at one call of a long loop (a transient
    fault, e.g. a stale workspace read): counted on the host through an io_callback."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback

    from echo_jax.transports import explicit

    original = explicit.p2p_allreduce
    calls = {"n": 0}

    def tick():
        calls["n"] += 1
        return np.bool_(40 <= calls["n"] < 48)  # loop step 5 of 500 (2 calls x 4 ranks a step)

    def p2p_allreduce(x_flat32, axis, num_ranks, config):
        y = original(x_flat32, axis, num_ranks, config)
        bad = io_callback(tick, jax.ShapeDtypeStruct((), jnp.bool_), ordered=False)
        first = jnp.where(bad, jnp.nextafter(y[0], jnp.float32(jnp.inf)), y[0])
        return y.at[0].set(first)

    _replace_everywhere(original, p2p_allreduce)


def _backward_cotangent_unscaled():
    _mutate_backward_site("site_all_reduce(ct_x, axis, config, choice, live_state, rescale,",
                          "site_all_reduce(ct_x, axis, config, choice, live_state, False,")


def _greedy_by_absolute_gain():
    from echo_jax import calibration
    mutate(calibration, "choose_site_configs",
           ("key = (math.inf if extra <= tol else gain / extra, gain)",
            "key = (math.inf if extra <= tol else gain, gain)"))


def _int_sum_in_float32():
    from echo_jax import collective
    mutate(collective, "_echo_leaf",
           ("return lax.psum(x, axis), None",
            "return (lax.psum(x, axis) if jnp.result_type(x) == jnp.bool_ else "
            "lax.psum(jnp.asarray(x, jnp.float32), axis).astype(jnp.result_type(x))), None"))


def _weak_only_for_python_floats():
    from echo_jax import collective
    mutate(collective, "_echo_leaf",
           ('weak = bool(getattr(jax.typeof(x), "weak_type", False))',
            "weak = isinstance(x, float)"))


def _auto_rescales():
    from echo_jax import transports
    mutate(transports, "resolve_rescale",
           ('if isinstance(rescale, str) and rescale == "auto":\n        return False',
            'if isinstance(rescale, str) and rescale == "auto":\n        return True'))


def _rescale_top_ignores_ranks():
    from echo_jax import collective
    mutate(collective, "rescale_factor",
           ("top = RESCALE_TOP_LOG2 - _ceil_log2(num_ranks) - int(headroom_log2)",
            "top = RESCALE_TOP_LOG2 - int(headroom_log2)"))


def _rescale_clamp_narrow():
    from echo_jax import collective
    mutate(collective, "rescale_factor",
           ("- e, -126, 120)", "- e, -20, 20)"))


def _no_axes_ignores_return_state():
    from echo_jax import collective
    mutate(collective, "echo_psum", ("return (x, state) if pair else x", "return x"))


def _gate_drops_state():
    from echo_jax import collective
    mutate(collective, "_echo_float",
           ("return lax.psum(x, axis), state", "return lax.psum(x, axis), None"))


def _column_backward_unscaled():
    from echo_jax import gspmd
    bwd = mutate(gspmd, "_column_input_bwd",
                 ("site_all_reduce(ct, axis, config, choice, None, rescale)",
                  "site_all_reduce(ct, axis, config, choice, None, False)"))
    gspmd._column_input.defvjp(gspmd._column_input_fwd, bwd)


def _broadcast_tangent_batched():
    from echo_jax import collective
    mutate(collective, "_broadcast_along_jvp",
           ("return _broadcast_along(x, axis), t",
            "return _broadcast_along(x, axis), jnp.where(lax.axis_index(axis) >= 0, t, t)"))


def _constants_not_sealed():
    from echo_jax import collective
    mutate(collective, "_sealed",
           ("return jax.jit(call)(*[flat[i] for i in where])",
            "return call(*[flat[i] for i in where])"))


def _unbound_axis_value_error():
    from echo_jax import collective
    mutate(collective, "axis_size", ("raise UnboundAxisError(", "raise ValueError("))


# A mutant of the C++ CPU handler: the handler's source (ffi/) with one change, compiled into a
# shared library of its own (the handlers are extern "C" XLA FFI symbols) and registered in place
# of echo_jax._ffi's handlers before any test runs. The build is cached by the hash of its inputs
# in the temporary directory (about 6 s on 2 cores the first time).
_NATIVE_SOURCE = "ffi/echo_allreduce_cpu.cc"
_NATIVE_HANDLERS = ("echo_allreduce_cpu", "echo_allreduce_comp_cpu", "echo_allreduce_applied_cpu",
                    "echo_allreduce_comp_q8_cpu")


def native_unavailable():
    """Why a mutant of the C++ handler cannot be built here (None when it can)."""
    import shutil

    from echo_jax.transports import cpu
    if "cpu" not in cpu.available_platforms():
        return "echo_jax._ffi (the CPU custom call) is not built"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ or $CXX) to build the mutated handler"
    return None


def _native_mutant(name, *edits, source="ffi/echo_allreduce_cpu.cc"):
    import ctypes
    import hashlib
    import pathlib
    import subprocess
    import tempfile

    import jax
    import jaxlib

    from echo_jax.transports import cpu
    repo = pathlib.Path(__file__).resolve().parents[1]
    # `source` is the handler's file or one of the headers it includes: the mutated file is
    # written beside a copy of the handler, whose quoted includes find it there first.
    src = (repo / source).read_text()
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"mutant {name} of {source}: expected one occurrence "
                               f"of {old!r}, found {src.count(old)}")
        src = src.replace(old, new)
    handler = (repo / _NATIVE_SOURCE).read_text() if source != _NATIVE_SOURCE else src
    include = jax.ffi.include_dir()
    cxx = os.environ.get("CXX", "c++")
    flags = ["-std=c++17", "-O2", "-DNDEBUG", "-fPIC", "-shared", "-ffp-contract=off",
             "-fno-fast-math", "-pthread"]
    digest = hashlib.sha256()
    for part in [src, handler, cxx, include, jaxlib.__version__, *flags] + [p.read_text() for p in
                                               sorted((repo / "ffi").glob("*.h"))]:
        digest.update(part.encode() + b"\0")
    out = pathlib.Path(tempfile.gettempdir()) / "echo_jax_mutants"
    lib = out / f"{name}-{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            cc = pathlib.Path(tmp) / "mutant.cc"
            cc.write_text(handler)
            if source != _NATIVE_SOURCE:
                (pathlib.Path(tmp) / pathlib.Path(source).name).write_text(src)
            so = pathlib.Path(tmp) / "mutant.so"
            proc = subprocess.run([cxx, *flags, f"-I{repo / 'ffi'}", "-isystem", include,
                                   str(cc), "-o", str(so)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"mutant {name}: the build failed:\n{proc.stderr[-3000:]}")
            os.replace(so, lib)   # atomic: a concurrent run sees the whole library or none
    handlers = ctypes.CDLL(str(lib))
    real = cpu._ffi

    class MutatedFfi:
        """echo_jax._ffi with the mutated handlers; everything else from the real module."""

        def registrations(self):
            return {h: jax.ffi.pycapsule(getattr(handlers, h)) for h in _NATIVE_HANDLERS}

        def __getattr__(self, attr):
            return getattr(real, attr)

    assert not cpu._registered, "the CPU handlers were registered before the mutant"
    cpu._ffi = MutatedFfi()


def _owner_sums_in_reverse_rank_order():
    """The owner's reduce loop runs r = P-1..0 (acc starts at rank P-1's value)."""
    indent = "\n        "
    _native_mutant(
        "owner_reverse_order",
        ("for (int r = 0; r < P; ++r) {" + indent + "float* v = r == 0 ? acc.data()",
         "for (int r = P - 1; r >= 0; --r) {" + indent + "float* v = r == P - 1 ? acc.data()"),
        ("if (r > 0) {" + indent + "  for (int t = 0; t < g; ++t) acc[t]",
         "if (r < P - 1) {" + indent + "  for (int t = 0; t < g; ++t) acc[t]"),
        source="ffi/cpu_protocol.h")


_owner_sums_in_reverse_rank_order.unavailable = native_unavailable


def _local_residual_with_the_tail_update():
    """The CPU handler's tail also runs the output-residual update in local mode."""
    _native_mutant("local_tail_update",
                   ("const bool update = cfg.update && !cfg.residual_local;",
                    "const bool update = cfg.update;"),
                   source="ffi/cpu_protocol.h")


_local_residual_with_the_tail_update.unavailable = native_unavailable


def _int8_state_keeps_the_old_scale():
    """The CPU handler's int8 / int4 store writes a group's new codes but leaves its old
    scale."""
    _native_mutant("q8_old_scale", ("  s[k0 / echo::kStateGroup] = sc.s;\n", "\n"),
                   source="ffi/cpu_protocol.h")


_int8_state_keeps_the_old_scale.unavailable = native_unavailable


C = "tests/echo_jax/test_collective.py::"
Q = "tests/echo_jax/test_quant.py::"
G = "tests/echo_jax/test_mutation_gaps.py::"
PC = "tests/echo_jax/test_psum_contract.py::"
QS = "tests/echo_jax/test_quant_scale.py::"
MUTANTS = {
    # (what it breaks, apply, killers: every one must fail)
    "doubled_scale": (
        "the quantizer's scale is twice what Eq. 8 / Eq. 9 give",
        _doubled_scale,
        [Q + "test_roundtrip_error_within_step[normal-asym-4]",
         C + "test_identical_ranks_and_bounded_error[asym-4-2]",
         C + "test_typed_shard_map_result_is_invariant_like_psum[xla]",
         C + "test_dtypes_and_odd_shapes[3-shape3-float32]",
         "tests/echo_jax/test_rotation.py::test_identical_ranks_and_transports[2-4-1000-float32]",
         "tests/echo_jax/test_tp.py::test_echo_gradients_within_tolerance[4-0.2-xla]"]),
    "naive_zero_point": (
        "the zero-aware policy keeps the naive zero-point in straddling groups",
        _naive_zero_point,
        [Q + "test_zero_aware_outlier_group_keeps_zero_and_near_zero_values[1.0-4]",
         C + "test_outlier_token_error_bound_zero_aware"]),
    "scale_rounded_down": (
        "the group scale is rounded down to bf16 (truncated), not up: values leave the grid",
        _scale_rounded_down,
        [Q + "test_bf16_round_up_is_the_next_bf16_at_or_above",
         QS + "test_scale_is_never_below_the_equation[sym]",
         QS + "test_scale_is_never_below_the_equation[asym]"]),
    "scale_rounded_to_nearest": (
        "the quantizer rounds the group scale to the nearest bf16, not up",
        _scale_rounded_to_nearest,
        [QS + "test_scale_is_never_below_the_equation[sym]",
         QS + "test_scale_is_never_below_the_equation[asym]",
         Q + "test_any_finite_magnitude_below_the_range_limit_stays_finite[asym-4]"]),
    "range_limit_inclusive": (
        "a group with max |x| exactly 2^126 is quantized (documented: NaN from 2^126 on)",
        _range_limit_inclusive,
        [Q + "test_any_finite_magnitude_below_the_range_limit_stays_finite[asym-4]",
         PC + "test_constant_groups_are_exact_up_to_the_range_limit"]),
    "range_limit_dropped": (
        "groups at or past 2^126 are quantized as finite groups, not sent as NaN",
        _range_limit_dropped,
        [Q + "test_any_finite_magnitude_below_the_range_limit_stays_finite[sym-8]",
         PC + "test_no_group_turns_nan_below_the_range_limit",
         C + "test_rescale_handles_tiny_and_huge_magnitudes",
         "tests/echo_jax/test_faults.py::"
         "test_rescale_modes_differ_only_at_the_format_limits[xla]"]),
    "scale_floor_raised": (
        "the scale floor of a non-constant group is 2^-90 instead of 2^-100",
        _scale_floor_raised,
        [Q + "test_tiny_magnitudes_use_the_scale_floor[asym]",
         "tests/echo_jax/test_faults.py::"
         "test_default_keeps_tiny_and_huge_contributions[float32-False-xla]"]),
    "own_segment_quantized": (
        "the owner adds its own segment quantized instead of in full precision",
        _own_segment_quantized,
        [C + "test_identical_ranks_and_bounded_error[asym-4-2]",
         C + "test_identical_ranks_and_bounded_error[sym-8-3]"]),
    "wrong_beta": (
        "the state update decays m1 with beta2 instead of beta1",
        _wrong_beta,
        ["tests/echo_jax/test_compensator.py::test_state_update_is_eq_11_exactly[4]",
         "tests/echo_jax/test_compensator.py::test_residuals_sum_to_minus_delta",
         "tests/echo_jax/test_rotation.py::test_compensator_state_semantics_in_the_original_basis",
         C + "test_pytrees"]),
    "straight_through_3t": (
        "the straight-through rule returns 3 t instead of psum(t)",
        _straight_through_3t,
        [C + "test_straight_through_gradient_values[xla-plain]",
         C + "test_straight_through_gradient_values[p2p-plain]",
         C + "test_jit_grad_scan_remat"]),
    "straight_through_fused": (
        "the fused custom call's derivative is t instead of psum(t)",
        _straight_through_fused,
        [C + "test_straight_through_gradient_values[p2p-compensated]"]),
    "swapped_backward_choice": (
        "the backward (f) sites of a per-layer policy run the other layer's config",
        _swapped_backward_choice,
        ["tests/echo_jax/test_tp.py::test_per_layer_bits_choice"]),
    "pytree_later_leaves_uncompensated": (
        "only the first leaf of a pytree is compensated; the others keep their state",
        _pytree_later_leaves_uncompensated,
        [C + "test_pytrees"]),
    "demo_delta_uncorrected": (
        "the demo measures delta_k against the uncorrected contributions",
        _demo_delta_uncorrected,
        ["tests/echo_jax/test_demo.py::test_rows_match_an_independent_replay"]),
    "experiments_delta_uncorrected": (
        "the error-process study measures delta_k against the uncorrected contributions",
        _experiments_delta_uncorrected,
        ["tests/models/test_experiments.py::test_instrumented_sites_match_a_numpy_replay"]),
    "cli_rotation_not_applied": (
        "--rotation is recorded in the config but the sites run unrotated",
        _cli_rotation_not_applied,
        ["tests/models/test_cli.py::test_rotation_flag_changes_the_sites"]),
    "bench_identity_vacuous": (
        "the benchmark's bit-identity check compares every rank with itself",
        _bench_identity_vacuous,
        ["tests/echo_jax/test_bench.py::test_compare_against_numpy"]),
    "p2p_transient_ulp": (
        "the custom call is 1 ulp off at a few calls in the middle of a long loop",
        _p2p_transient_ulp,
        ["tests/echo_jax/test_p2p_cpu.py::test_repeated_calls_stay_correct"]),
    "backward_cotangent_unscaled": (
        "the backward (f) site reduces the cotangent without its power-of-two rescaling",
        _backward_cotangent_unscaled,
        [G + "test_tiny_cotangents_survive_the_backward_all_reduce[xla]",
         G + "test_tiny_cotangents_survive_the_backward_all_reduce[p2p]"]),
    "greedy_by_absolute_gain": (
        "the greedy site choice ranks upgrades by gain instead of gain per extra wire bit",
        _greedy_by_absolute_gain,
        [G + "test_greedy_ranks_upgrades_by_gain_per_extra_bit"]),
    "int_sum_in_float32": (
        "integer leaves are summed in float32 (inexact past 2^24) instead of by psum",
        _int_sum_in_float32,
        [PC + "test_integer_sums_are_exact_where_float32_is_not",
         PC + "test_int64_sums_are_exact_with_x64"]),
    "weak_only_for_python_floats": (
        "only a Python float keeps its weak type; weak arrays come back strongly typed",
        _weak_only_for_python_floats,
        [PC + "test_weak_types_beyond_python_literals"]),
    "auto_rescales": (
        "rescale='auto' (the default) rescales, as True does (documented: no rescaling)",
        _auto_rescales,
        [C + "test_hlo_of_the_custom_call_has_no_collective_of_x",
         "tests/echo_jax/test_faults.py::test_compensated_call_stays_fused_with_every_rescale"
         "[auto]"]),
    "rescale_top_ignores_ranks": (
        "the rescaling's bound leaves out the reduce stage's P copies (2^15, not 2^15 / P)",
        _rescale_top_ignores_ranks,
        [PC + "test_rescale_factor_is_the_documented_power_of_two"]),
    "rescale_clamp_narrow": (
        "the rescaling's exponent is clamped to [-20, 20] instead of fp32's normal range",
        _rescale_clamp_narrow,
        [PC + "test_rescale_factor_is_the_documented_power_of_two"]),
    "no_axes_ignores_return_state": (
        "echo_psum over no axes returns x alone even with a state or return_state=True",
        _no_axes_ignores_return_state,
        [PC + "test_return_conventions_in_edge_cases"]),
    "gate_drops_state": (
        "below the size gate the compensator state comes back None instead of unchanged",
        _gate_drops_state,
        [PC + "test_return_conventions_in_edge_cases"]),
    "column_backward_unscaled": (
        "column_parallel_matmul's backward all-reduce runs without its power-of-two rescaling",
        _column_backward_unscaled,
        [PC + "test_gspmd_site_backward_is_power_of_two_equivariant[column]"]),
    "broadcast_tangent_batched": (
        "the broadcast of an unbatched value batches its tangent (gradients not psum's)",
        _broadcast_tangent_batched,
        [PC + "test_gradient_has_psum_batching_under_vmap"]),
    "constants_not_sealed": (
        "the protocol's constants are hoisted into echo_psum's jaxpr as constvars",
        _constants_not_sealed,
        [PC + "test_jaxpr_has_no_constants_on_any_path",
         PC + "test_initial_style_vmap_with_collective[custom_jvp]",
         PC + "test_initial_style_vmap_with_collective[custom_vjp]"]),
    "unbound_axis_value_error": (
        "an unbound axis name raises a plain ValueError where psum raises NameError",
        _unbound_axis_value_error,
        [PC + "test_unbound_axis_raises_name_error_as_psum"]),
    "owner_reverse_order": (
        "the CPU handler's owner sums its segment in rank order P-1..0 (C++ mutant, built)",
        _owner_sums_in_reverse_rank_order,
        [G + "test_owner_sums_in_rank_order_on_a_rounding_boundary"]),
    "int8_scale_a_power_coarser": (
        "the int8 / int4 state's scale is twice the smallest power of two that holds max|v| / "
        "127 (/ 7)",
        _int8_scale_a_power_coarser,
        ["tests/echo_jax/test_state_int8.py::test_the_format_matches_the_numpy_reference[int8]",
         "tests/echo_jax/test_state_int8.py::"
         "test_one_call_matches_algorithm_1_with_the_int8_store",
         "tests/echo_jax/test_state_int8.py::test_the_format_matches_the_numpy_reference[int4]"]),
    "local_residual_push_error_on_own_segment": (
        "the local residual of the owned segment is its push error, not the sum's s - Q(s)",
        _local_residual_push_error_on_own_segment,
        ["tests/echo_jax/test_compensator.py::"
         "test_local_residuals_are_each_ranks_rounding_errors[False]"]),
    "local_residual_with_the_tail_update": (
        "the CPU handler's local-residual call also updates the state where y is produced "
        "(C++ mutant, built)",
        _local_residual_with_the_tail_update,
        ["tests/echo_jax/test_residual_local.py::test_the_cpu_call_matches_the_xla_transport_"
         "bit_for_bit[P3-x_float32-state_float32-rescaled]"]),
    "int8_state_keeps_the_old_scale": (
        "the CPU handler's int8 / int4 state store leaves a group's old scale (C++ mutant, "
        "built)",
        _int8_state_keeps_the_old_scale,
        ["tests/echo_jax/test_state_int8.py::"
         "test_the_cpu_call_matches_the_jax_path_bit_for_bit[f32]",
         "tests/echo_jax/test_state_int4_cpu.py::"
         "test_the_cpu_call_matches_the_jax_path_bit_for_bit[f32-output]"]),
}


def pytest_configure(config):
    name = os.environ.get(ENV)
    if not name:
        return
    if name not in MUTANTS:
        raise RuntimeError(f"{ENV}={name!r}: no such mutant (have {sorted(MUTANTS)})")
    MUTANTS[name][1]()


def pytest_report_header(config):
    name = os.environ.get(ENV)
    return f"mutant: {name} ({MUTANTS[name][0]})" if name in MUTANTS else None


def pytest_terminal_summary(terminalreporter):
    name = os.environ.get(ENV)
    if name in MUTANTS:
        terminalreporter.write_line(f"mutant applied: {name}")
