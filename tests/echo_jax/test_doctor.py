"""Never silent: where the Echo custom call cannot run, "auto" says why once, "p2p" raises with
the same words, and `python -m echo_jax doctor` shows them.

No GPU is needed: each test changes what the CUDA transport's availability check inspects (the
platform of the trace, the module loader, the module's build info, the process count, the
devices, the CUDA driver's answer on peer access), never the check itself, and asks the real
`transports.availability` through its users: `resolve_transport` / `echo_psum` inside a
shard_map over CPU devices, and the doctor command.
"""

import json
import types
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import echo_jax as ej
from conftest import make_mesh, put
from echo_jax import collective, transports
from echo_jax.__main__ import main
from echo_jax.transports import base, cpu, cuda

AUTO, FORCED = ej.EchoConfig(transport="auto"), ej.EchoConfig(transport="p2p")
FALLBACK = transports.EchoFallbackWarning


@pytest.fixture(autouse=True)
def fresh():
    """Each test starts with no fallback warning shown and no peer-access answer cached."""
    transports.reset_fallback_warnings()
    cuda.can_access_peer.cache_clear()
    yield
    transports.reset_fallback_warnings()
    cuda.can_access_peer.cache_clear()


# --------------------------------------------------------------------------------------------
# The environment the check inspects


def on_gpu_platform(monkeypatch):
    """Traces here run on "cuda" (the platform the abstract mesh's device reports)."""
    monkeypatch.setattr(base, "current_platform", lambda mesh=None: "cuda")


def cuda_module(monkeypatch, api=None, jaxlib_version=None, **recorded):
    """echo_jax._ffi_cuda loads, built against these FFI headers (default: the runtime's);
    `recorded`: more build_info() keys (an older build records no "cuda" / architectures)."""
    info = {"jaxlib": jaxlib_version or jaxlib.__version__,
            "xla_ffi_api": api or base.runtime_ffi_api() or (0, 0), **recorded}
    module = types.SimpleNamespace(build_info=lambda: dict(info), registrations=lambda: {})
    monkeypatch.setattr(cuda, "_module", lambda: module)


def no_cuda_module(monkeypatch):
    """echo_jax._ffi_cuda was not built (no nvcc at install time)."""
    def missing():
        raise ImportError("No module named 'echo_jax._ffi_cuda'")
    monkeypatch.setattr(cuda, "_module", missing)


class Driver:
    """libcuda as ctypes sees it: cuDeviceGet and cuDeviceCanAccessPeer over GPU islands
    (peer access inside an island, none between them)."""

    def __init__(self, islands):
        self.island = {gpu: k for k, members in enumerate(islands) for gpu in members}

    def cuDeviceGet(self, ref, ordinal):
        ref._obj.value = int(ordinal)
        return 0

    def cuDeviceCanAccessPeer(self, ref, device, peer):
        ref._obj.value = int(self.island[device.value] == self.island[peer.value])
        return 0


def driver(monkeypatch, islands):
    monkeypatch.setattr(cuda, "_driver", lambda: Driver(islands))


def gpu_devices(n):
    """n local GPUs of this process, as jax.local_devices() lists them."""
    return [types.SimpleNamespace(id=i, platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                  process_index=0, local_hardware_id=i) for i in range(n)]


def mesh_of_local_gpus(monkeypatch):
    """The concrete mesh's devices count as GPUs of this process (ordinal = device id)."""
    monkeypatch.setattr(cuda, "_local_gpu_ordinal", lambda d: int(d.id))


# --------------------------------------------------------------------------------------------
# Asking through the users of `availability`


def traced(fn, num_ranks=4, set_mesh=False):
    """fn() traced inside a shard_map over 'tp' (num_ranks CPU devices); its result."""
    mesh = make_mesh((num_ranks,), ("tp",))
    out = {}

    def body(v):
        out["value"] = fn()
        return v

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    x = put(np.zeros(2 * num_ranks, np.float32), mesh, P("tp"))
    if set_mesh:
        with jax.set_mesh(mesh):
            f(x)
    else:
        f(x)
    return out["value"]


def fallback_warnings(record):
    return [w for w in record if issubclass(w.category, FALLBACK)]


def check_warns_once_and_p2p_raises(expected, num_elements=None, set_mesh=False):
    """'auto' warns once (with the reason), 'p2p' raises with the same reason."""
    found = traced(lambda: transports.availability(axis="tp"), set_mesh=set_mesh)
    assert found.name == "xla" and found.kind == expected, found
    assert found.warns
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):  # once per process and reason, however often it is traced
            name = traced(lambda: collective.resolve_transport(AUTO, "tp", num_elements),
                          set_mesh=set_mesh)
            assert name == "xla"
    shown = fallback_warnings(record)
    assert len(shown) == 1, [str(w.message) for w in shown]
    message = str(shown[0].message)
    assert found.reason in message and f"({expected})" in message
    assert "python -m echo_jax doctor" in message
    assert shown[0].filename == __file__  # attributed to the caller, not to echo_jax or jax
    with pytest.raises(ValueError) as err:
        traced(lambda: collective.resolve_transport(FORCED, "tp", num_elements),
               set_mesh=set_mesh)
    assert found.reason in str(err.value)
    assert "EchoConfig.transport='p2p' cannot run here" in str(err.value)
    return found


def doctor(monkeypatch, capsys, devices, *args):
    """`python -m echo_jax doctor` over these local devices: (exit status, text, JSON)."""
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: list(devices))
    status = main(["doctor", *args])
    text = capsys.readouterr().out
    assert main(["doctor", "--json", *args]) == status
    return status, text, json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------------------------
# Each reason on a GPU platform: the warning, the p2p error, the doctor


def test_cuda_handlers_not_built(monkeypatch, capsys):
    on_gpu_platform(monkeypatch)
    no_cuda_module(monkeypatch)
    found = check_warns_once_and_p2p_raises("not_built")
    assert "echo_jax._ffi_cuda" in found.reason and "nvcc" in found.reason
    assert "pip install --force-reinstall --no-deps -e ." in found.reason

    status, text, record = doctor(monkeypatch, capsys, gpu_devices(4))
    assert status == 1 and record["platform"] == "cuda" and record["problems"] == 3
    assert "echo_jax._ffi_cuda   not built: " + found.reason in text
    assert "P=2   xla  [not_built]  EchoFallbackWarning" in text
    assert f"[not_built] {found.reason}" in text
    assert "4 x NVIDIA H100 80GB HBM3" in text
    module = record["modules"][1]
    assert module["name"] == "echo_jax._ffi_cuda" and not module["built"]


def test_cuda_handlers_refused_by_this_jaxlib(monkeypatch, capsys):
    major, minor = base.runtime_ffi_api()
    on_gpu_platform(monkeypatch)
    cuda_module(monkeypatch, api=(major, minor + 1), jaxlib_version="99.0")
    found = check_warns_once_and_p2p_raises("build_mismatch")
    assert "jaxlib 99.0" in found.reason and f"FFI API {major}.{minor + 1}" in found.reason
    assert "pip install --force-reinstall --no-deps -e ." in found.reason

    status, text, record = doctor(monkeypatch, capsys, gpu_devices(2))
    assert status == 1
    assert (f"echo_jax._ffi_cuda   built: headers of jaxlib 99.0, XLA FFI API {major}."
            f"{minor + 1}, CUDA architectures unknown") in text
    assert "REFUSED: " + found.reason in text
    assert "P=2   xla  [build_mismatch]  EchoFallbackWarning" in text
    assert record["modules"][1]["built"] and not record["modules"][1]["accepted"]


def test_the_module_line_names_the_cuda_release_and_architectures(monkeypatch, capsys):
    # What CMakeLists.txt compiles into build_info(): the nvcc release, CMake's architectures.
    on_gpu_platform(monkeypatch)
    cuda_module(monkeypatch, cuda="13.0.88", cuda_architectures="80-real,90a-real,80-virtual")
    status, text, record = doctor(monkeypatch, capsys, gpu_devices(2))
    assert ("XLA FFI API" in text and ", CUDA 13.0.88, CUDA architectures "
            "80-real,90a-real,80-virtual; accepted by this jaxlib") in text
    assert record["modules"][1]["cuda"] == "13.0.88"


def test_several_processes(monkeypatch, capsys):
    on_gpu_platform(monkeypatch)
    cuda_module(monkeypatch)
    monkeypatch.setattr(jax, "process_count", lambda *a: 2)
    found = check_warns_once_and_p2p_raises("processes")
    assert "2 processes" in found.reason and "one process" in found.reason

    status, text, _ = doctor(monkeypatch, capsys, gpu_devices(2))
    assert status == 1 and "(2 local devices, 2 processes)" in text
    assert "P=2   xla  [processes]  EchoFallbackWarning" in text and found.reason in text


def test_no_concrete_mesh(monkeypatch):
    """Inside shard_map but not under jax.set_mesh: the GPUs of a group are not known. (The
    doctor asks about an axis under jax.set_mesh, so it never reports this one.)"""
    on_gpu_platform(monkeypatch)
    cuda_module(monkeypatch)
    found = check_warns_once_and_p2p_raises("mesh")
    assert "jax.set_mesh" in found.reason


def test_gpus_without_peer_access(monkeypatch, capsys):
    on_gpu_platform(monkeypatch)
    cuda_module(monkeypatch)
    mesh_of_local_gpus(monkeypatch)
    driver(monkeypatch, islands=[(0, 1), (2, 3)])
    found = check_warns_once_and_p2p_raises("peer_access", set_mesh=True)
    assert "GPU 0 has no peer access to GPU 2" in found.reason
    assert "nvidia-smi topo -p2p r" in found.reason
    # Where every pair has it, the custom call is chosen.
    cuda.can_access_peer.cache_clear()
    driver(monkeypatch, islands=[(0, 1, 2, 3)])
    assert traced(lambda: transports.availability(axis="tp"), set_mesh=True) == (
        "p2p", None, None, "cuda")

    # Two NVLink islands of four GPUs: axes of up to 4 run the custom call, wider ones do not.
    cuda.can_access_peer.cache_clear()
    driver(monkeypatch, islands=[(0, 1, 2, 3), (4, 5, 6, 7)])
    status, text, record = doctor(monkeypatch, capsys, gpu_devices(8))
    assert status == 1 and record["problems"] == 4
    assert [a["transport"] for a in record["axes"]] == ["p2p"] * 3 + ["xla"] * 4
    assert "P=4   p2p  (plans as above)\n  P=5   xla  [peer_access]  EchoFallbackWarning" in text
    assert "[peer_access] GPU 0 has no peer access to GPU 4" in text
    # The plans of each axis: fused on the custom call, in JAX around the "xla" transport.
    plans = {a["size"]: a["plans"] for a in record["axes"]}
    assert plans[2]["compensated"].startswith("transport p2p (custom call), rotation none, "
                                              "compensation fused, update in_call")
    assert "rotation call, compensation fused" in plans[2]["compensated, rotated"]
    assert "compensation applied, update separate" in plans[2]["compensated, separate update"]
    assert plans[5]["compensated, rotated"].startswith(
        "transport xla, rotation jax, compensation jax")
    assert "(plans as above)" in text.split("P=6")[1].splitlines()[0]


def test_too_many_ranks(monkeypatch, capsys):
    """More ranks than the CUDA call takes (the doctor's fake GPUs: the CPU mesh has 8)."""
    cuda_module(monkeypatch)
    driver(monkeypatch, islands=[range(16)])
    found = transports.availability("gpu", devices=gpu_devices(16))
    assert found.kind == "ranks" and found.warns and "at most 8 GPUs" in found.reason
    with pytest.warns(FALLBACK, match="at most 8 GPUs"):
        assert transports.warn_fallback(found)
    assert not transports.warn_fallback(found)  # once

    status, text, _ = doctor(monkeypatch, capsys, gpu_devices(16), "--axis-size", "8", "16")
    assert status == 1
    assert "  P=8   p2p\n" in text and "\n  P=16  xla  [ranks]  EchoFallbackWarning" in text


def test_beyond_the_size_limits(monkeypatch):
    on_gpu_platform(monkeypatch)
    cuda_module(monkeypatch)
    mesh_of_local_gpus(monkeypatch)
    driver(monkeypatch, islands=[range(8)])
    big = ej.EchoConfig(group_size=1 << 17)
    found = traced(lambda: transports.availability(axis="tp", config=big, num_elements=1000),
                   set_mesh=True)
    assert found.kind == "limits" and "exceeds" in found.reason
    with pytest.warns(FALLBACK, match="exceeds the custom call's limit"):
        assert traced(lambda: collective.resolve_transport(big, "tp", 1000),
                      set_mesh=True) == "xla"


def test_one_warning_per_reason_not_per_call(monkeypatch):
    """Two reasons, two warnings; the same reason again, none; reset, one again."""
    on_gpu_platform(monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        no_cuda_module(monkeypatch)
        traced(lambda: collective.resolve_transport(AUTO, "tp"))
        traced(lambda: collective.resolve_transport(AUTO, "tp"))
        cuda_module(monkeypatch)
        traced(lambda: collective.resolve_transport(AUTO, "tp"))  # no set_mesh: "mesh"
        traced(lambda: collective.resolve_transport(AUTO, "tp"))
        transports.reset_fallback_warnings()
        traced(lambda: collective.resolve_transport(AUTO, "tp"))
    kinds = [str(w.message).split("for this reason (")[1].split(")")[0]
             for w in fallback_warnings(record)]
    assert kinds == ["not_built", "mesh", "mesh"]


def test_echo_psum_falls_back_with_the_xla_bits(monkeypatch):
    """What the warning announces: echo_psum runs, with the 'xla' transport's bits."""
    on_gpu_platform(monkeypatch)
    no_cuda_module(monkeypatch)
    mesh = make_mesh((4,), ("tp",))
    x = put(np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32), mesh,
            P("tp"))

    def run(cfg):
        return jax.jit(jax.shard_map(lambda v: ej.echo_psum(v, "tp", config=cfg), mesh=mesh,
                                     in_specs=P("tp"), out_specs=P("tp")))(x)

    with pytest.warns(FALLBACK, match=r"runs the pure-JAX 'xla' transport on cuda"):
        y = run(AUTO)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(run(AUTO.replace(transport="xla"))))


# --------------------------------------------------------------------------------------------
# What does not warn


def test_the_trace_itself_never_warns_on_a_gpu(monkeypatch):
    """Under vmap, or outside shard_map, only 'xla' can run: nothing to fix, nothing said."""
    on_gpu_platform(monkeypatch)
    no_cuda_module(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FALLBACK)
        jax.vmap(lambda v: (collective.resolve_transport(AUTO, "i"), v)[1],
                 axis_name="i")(jnp.zeros((2, 3)))
        assert collective.resolve_transport(AUTO, "tp") == "xla"
        assert transports.availability(axis="tp").kind == "context"


def test_nothing_warns_on_cpu(monkeypatch, capsys):
    """The CPU handler built: 'auto' runs it in shard_map, 'xla' under vmap, no warning; the
    doctor says so and exits 0."""
    if "cpu" not in cpu.available_platforms():
        pytest.skip("the CPU custom call is not built")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FALLBACK)
        assert traced(lambda: collective.resolve_transport(AUTO, "tp")) == "p2p"
        jax.vmap(lambda v: (collective.resolve_transport(AUTO, "i"), v)[1],
                 axis_name="i")(jnp.zeros((2, 3)))
        assert traced(lambda: transports.availability(axis="tp")).warns is False
    status, text, record = doctor(monkeypatch, capsys, jax.devices("cpu")[:4])
    assert status == 0 and record["problems"] == 0, text
    assert record["platform"] == "cpu"
    assert [a["transport"] for a in record["axes"]] == ["p2p"] * 3
    assert "echo_jax._ffi        built: headers of jaxlib" in text
    assert "platforms cpu; accepted by this jaxlib" in text
    assert f"jaxlib {jaxlib.__version__}" in text and "flax " in text


def test_cpu_handler_missing(monkeypatch, capsys):
    """On CPU the one reason worth a word: echo_jax._ffi missing (or refused)."""
    monkeypatch.setattr(cpu, "_ffi", None)
    monkeypatch.setattr(cpu, "_import_error", "No module named 'echo_jax._ffi'")
    found = check_warns_once_and_p2p_raises("not_built")
    assert found.platform == "cpu" and "echo_jax._ffi is missing" in found.reason
    assert "pip install --force-reinstall --no-deps -e ." in found.reason
    status, text, record = doctor(monkeypatch, capsys, jax.devices("cpu")[:2])
    assert status == 1 and "echo_jax._ffi        not built: " + found.reason in text
    assert "P=2   xla  [not_built]  EchoFallbackWarning" in text


def test_doctor_without_enough_devices(monkeypatch, capsys, tmp_path):
    """An axis wider than the devices present: said, and not a fallback."""
    status, text, record = doctor(monkeypatch, capsys, jax.devices("cpu")[:1], "--axis-size",
                                  "1", "3")
    assert main(["doctor", "--axis-size", "1", "3", "--json", str(tmp_path / "d.json")]) == status
    assert capsys.readouterr().out.strip() == text.strip()  # the text, and the JSON to the file
    assert json.loads((tmp_path / "d.json").read_text())["axes"] == record["axes"]
    assert record["axes"][1]["transport"] is None and record["axes"][1]["kind"] == "devices"
    assert "P=3   -    an axis of 3 ranks needs 3 devices, this process has 1" in text
    assert "xla_force_host_platform_device_count=3" in text
    assert status == (0 if "cpu" in cpu.available_platforms() else 1)


def test_doctor_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["doctor", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--axis-size" in out and "--json" in out and "EchoFallbackWarning" in out


def test_the_warning_is_public():
    assert ej.EchoFallbackWarning is transports.EchoFallbackWarning
    assert issubclass(ej.EchoFallbackWarning, UserWarning)
    assert set(transports.WARNING_KINDS["cuda"]) <= set(transports.REASON_KINDS)
