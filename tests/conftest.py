"""Test setup: 8 fake CPU devices (before JAX starts), GPU marker, mesh helpers."""

import importlib.util
import os
import shutil
import tempfile

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


def _gpu_plugin_installed() -> bool:
    """Whether jax[cuda] is installed (its plugin modules; without importing JAX)."""
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12",
                 "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # a dotted name whose parent is not installed
            pass
    return False


def _compile_cpu_programs_quickly():
    """XLA's CPU backend at LLVM optimization level 0 for the tests' programs: most are small,
    run once or twice and compiled anew for each shape, so compiling is most of a test's time
    (docs/testing.md gives the fast set's time at both levels). The level does not change
    results: XLA's CPU code has no fast-math at any level
    (`xla_cpu_enable_fast_math` is off), so LLVM may not reassociate or contract float
    arithmetic, and the bit-for-bit tests pass at both. Not where XLA_FLAGS sets a level, and
    not where a CUDA plugin is installed (the flag also sets the GPU backend's level)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" in flags or _gpu_plugin_installed():
        return
    os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()


_compile_cpu_programs_quickly()

#: Set by the process that made the run's compilation cache (the folder is its to delete).
_CACHE_OWNER_ENV = "ECHO_JAX_TESTS_CACHE_OWNER"


def _share_compiled_programs():
    """One JAX persistent compilation cache for the run, in a new temporary folder: many tests
    compile the same program (the same call on the same shapes, another function object), and
    the xdist workers and the subprocesses of the tests, which inherit this environment, share
    what one of them compiled. A loaded executable is the one XLA compiled, so results keep
    their bits. Not where the user set a cache; off under a mutant (tests/mutants.py), whose
    rewritten C++ handler a program's key does not see."""
    if os.environ.get("ECHO_JAX_MUTANT"):
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # inherited from the parent run
        return
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="echo_jax_tests_jit_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ[_CACHE_OWNER_ENV] = str(os.getpid())


_share_compiled_programs()

import jax  # noqa: E402
from jax import lax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def cuda_handlers():
    """echo_jax.transports.cuda with its CUDA handlers, for the `cuda` fixtures of the GPU tests.

    Skips where there is no GPU. Where there is one, a missing or unusable echo_jax._ffi_cuda is
    a failure, not a skip: a GPU run that silently skipped every kernel test would pass while
    testing nothing.
    """
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    from echo_jax.transports import cuda
    from echo_jax.transports.base import build_mismatch
    try:
        cuda._module()
    except ImportError as err:
        pytest.fail(
            "a GPU is present (jax.devices('gpu') is not empty) but the CUDA handlers "
            f"echo_jax._ffi_cuda were not built ({err}). Build them where nvcc is found: "
            "`pip install -e .` (CMake adds the CUDA module when it finds a CUDA compiler and "
            "ECHO_JAX_CUDA is not OFF; check `nvcc --version` / CUDACXX), or `STEPS=build "
            ".ci/gpu`, which builds it with CMake + Ninja and copies _ffi_cuda*.so into echo_jax/.",
            pytrace=False)
    mismatch = build_mismatch(cuda.build_info(), "echo_jax._ffi_cuda")
    if mismatch is not None:
        pytest.fail(f"a GPU is present but {mismatch}", pytrace=False)
    return cuda


#: Worker processes of a parallel run at most: each holds a JAX runtime with 8 fake devices (about
#: 1 GB), and the suite's files are few enough that more would mostly wait on the largest one.
MAX_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Runs the files on several worker processes (pytest-xdist, whole files per worker, so that a
    file's module-scoped compiled programs are shared by its tests) unless `-n` was given, xdist
    is not installed, or a GPU is present (one process holds the GPU: several would time-slice
    its spinning kernels and each would preallocate most of its memory)."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.getoption("numprocesses", None) is not None
            or config.getoption("collectonly", False) or has_gpu()):
        return None
    config.option.numprocesses = "auto"
    config.option.dist = "loadfile"
    return None


def pytest_unconfigure(config):
    """The process that made the run's compilation cache deletes it."""
    if os.environ.get(_CACHE_OWNER_ENV) == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist, absent without it
def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def _explicit_selection(config) -> bool:
    """A `-m` expression, or a test named by id (file::test), selects the slow tests too."""
    return bool(config.getoption("markexpr", "")) or any(
        "::" in str(arg) for arg in config.args)


def pytest_collection_modifyitems(config, items):
    # grid(*ids): the cases of a parametrized test other than `ids` are slow.
    for item in items:
        grid = item.get_closest_marker("grid")
        callspec = getattr(item, "callspec", None)
        if grid is not None and callspec is not None and callspec.id not in grid.args:
            item.add_marker(pytest.mark.slow)
    # The fast set: the slow tests are deselected unless the selection is explicit.
    if not _explicit_selection(config):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def reference_allreduce(x, cfg, state=None, rescale=False):
    """The "xla" transport over P simulated ranks (vmap over the leading axis of x): the
    reference of the CUDA custom call's virtual ranks, bit for bit (`rescale` as echo_psum's;
    False by default, as a virtual call without a factor)."""
    import echo_jax as ej
    cfg = cfg.replace(transport="xla")
    if state is None:
        return jax.jit(jax.vmap(lambda v: ej.echo_psum(v, "tp", config=cfg, rescale=rescale),
                                axis_name="tp"))(x)
    return jax.jit(jax.vmap(lambda v, s: ej.echo_psum(v, "tp", config=cfg, state=s,
                                                      rescale=rescale),
                            axis_name="tp"))(x, state)


def compensated_sites(cfg, xs, rescale=False):
    """Compensated echo_psum sites in a row, the state carried from one to the next (as a
    model's layers), under shard_map over "tp" = the rows of xs [P, steps, n], compiled.

    Returns ((y [P, steps, n], m1 [P, n], m2 [P, n]), the compiled program's text); asserts
    that the sites take cfg.transport.
    """
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec
    import echo_jax as ej
    from echo_jax import collective

    nranks, steps, n = xs.shape
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:nranks]), ("tp",))

    def body(x):
        assert collective.resolve_transport(cfg, "tp", n) == cfg.transport
        s = ej.init_state(x[0, 0], cfg)   # typed varying over "tp", as x[0, 0] is
        outs = []
        for i in range(steps):
            y, s = ej.echo_psum(x[0, i], "tp", config=cfg, state=s, rescale=rescale)
            outs.append(lax.pcast(y, "tp", to="varying"))
        return jnp.stack(outs)[None], s.m1[None], s.m2[None]

    rows = PartitionSpec("tp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rows, out_specs=(rows,) * 3))
    args = jax.device_put(xs, NamedSharding(mesh, rows))
    return f(args), f.lower(args).compile().as_text()


def quantized_state_sites(cfg, xs, steps, rescale="auto", init=None):
    """`steps` compensated echo_psum calls in a row on the rows of xs [P, n] under shard_map
    over "tp" (x times 2^-step: exact, so that XLA cannot fuse the product into the JAX path's
    apply step, where the call takes it rounded), the state carried from init(x) (default:
    init_state; an int8 or int4 state's tests compare its codes and scales); returns
    ((ys [P, steps, n], state), the jitted program)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec
    import echo_jax as ej

    nranks = xs.shape[0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:nranks]), ("tp",))
    rows = PartitionSpec("tp")

    def body(x):
        s = ej.init_state(x[0], cfg) if init is None else init(x[0])
        ys = []
        for i in range(steps):
            y, s = ej.echo_psum(x[0] * 2.0 ** -i, "tp", config=cfg, state=s, rescale=rescale)
            ys.append(as_varying(y, ("tp",)))
        return jnp.stack(ys)[None], jax.tree.map(lambda a: a[None], s)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rows, out_specs=rows))
    return f(jax.device_put(xs, NamedSharding(mesh, rows))), f


def make_mesh(shape, names):
    """A mesh over the first prod(shape) devices (Auto axes: inputs may arrive unsharded)."""
    n = int(np.prod(shape))
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def as_varying(y, axes):
    """Per-rank values out of shard_map (no runtime cost): type y as varying over `axes`."""
    mat = getattr(jax.typeof(y), "mat", None)
    have = set(mat.varying) if mat is not None else set()
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(y, missing, to="varying") if missing else y
