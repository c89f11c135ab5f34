"""`python -m echo_jax doctor`: what this install runs, and why not the custom call.

`collect` gathers, without compiling anything: the platform and the local devices, the
versions of Python, echo_jax, jax, jaxlib (and its XLA FFI API) and flax, the kill switch, the
custom-call modules (`echo_jax._ffi`, `echo_jax._ffi_cuda`: built or not, the jaxlib headers and
the XLA FFI API they were compiled against, the CUDA architectures where the build records them,
accepted by this jaxlib or not), and for each axis size P the transport that `transport="auto"`
gives an `echo_psum` over one mesh axis of the first P local devices (inside a `jax.shard_map`
manual over it, under `jax.set_mesh`), with the reason and its fix where it is not the custom
call, and the plan of a few typical calls over that axis (`echo_jax.transports.plan_with`:
where the rotation runs, whether the compensator is fused). The answers are `echo_jax.transports.availability`'s, the same sentences as the fallback
warning (`EchoFallbackWarning`) and the "p2p" error. `format_report` prints them.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import os
import platform as _platform

import jax

import echo_jax
from echo_jax import transports
from echo_jax.config import EchoConfig
from echo_jax.transports import base, cpu, cuda

#: The largest axis size asked about by default (the CUDA custom call's limit).
DEFAULT_MAX_AXIS_SIZE = cuda.MAX_RANKS


def default_axis_sizes(num_devices: int) -> tuple[int, ...]:
    """The axis sizes asked about by default: P = 2 up to the local devices (at most
    DEFAULT_MAX_AXIS_SIZE), or the one device alone."""
    top = min(num_devices, DEFAULT_MAX_AXIS_SIZE)
    return tuple(range(2, top + 1)) if top >= 2 else (1,)


#: The distributions of jaxlib's CUDA plugin (`pip install jax[cuda13]` / `jax[cuda12]`).
CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _api(value) -> str | None:
    return None if value is None else ".".join(str(int(v)) for v in value)


def _module(name: str, transport) -> dict:
    """One custom-call module: built, what against, accepted by this jaxlib."""
    found = transport.module_reason()
    info = transport.build_info()
    kind, reason = (None, None) if found is None else found
    out = {"name": name, "built": kind != "not_built", "accepted": found is None, "kind": kind,
           "reason": reason, "jaxlib": info.get("jaxlib"),
           "xla_ffi_api": _api(info.get("xla_ffi_api"))}
    if transport is cpu:
        out["platforms"] = list(cpu.available_platforms())
    else:
        archs = info.get(cuda.ARCHITECTURES_KEY)
        out["cuda"] = info.get("cuda") or "unknown"
        out["cuda_architectures"] = (
            "unknown" if not archs else
            archs if isinstance(archs, str) else ";".join(str(a) for a in archs))
    return out


def _axis(size: int, platform: str, devices) -> dict:
    """What "auto" runs over one mesh axis of the first `size` local devices."""
    if size > len(devices):
        hint = (f" (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={size} fakes "
                "them)" if platform == "cpu" else "")
        return {"size": size, "transport": None, "kind": "devices", "warns": False,
                "reason": f"an axis of {size} ranks needs {size} devices, this process has "
                          f"{len(devices)}{hint}"}
    found = transports.availability(platform, devices=list(devices[:size]))
    return {"size": size, "transport": found.name, "kind": found.kind, "warns": found.warns,
            "reason": found.reason, "plans": _plans(found, platform, size)}


#: The calls whose plan the doctor shows for each axis: (label, EchoConfig fields, state).
PLANNED_CALLS = (
    ("plain", {}, False),
    ("compensated", {}, True),
    ("compensated, rotated", {"rotation": "hadamard"}, True),
    ("compensated, separate update", {"state_update": "separate"}, True),
)


def _plans(found, platform: str, size: int) -> dict:
    """{label: `CallPlan.describe()`} of the PLANNED_CALLS over an axis with this availability
    (`transports.plan_with`: the transport "auto" gets there, the rules of `transports.plan`)."""
    if size == 1:
        return {"every call": "P = 1: echo_psum returns x as it is (nothing is quantized or "
                              "sent; the state passes through)"}
    if os.environ.get(transports.FORCE_XLA_ENV, "") not in ("", "0"):
        chosen, fallback = transports.XLA, f"{transports.FORCE_XLA_ENV} is set"
    elif found.reason is None:
        chosen, fallback = transports.custom_call(platform), None
    else:
        chosen, fallback = transports.XLA, found.reason
    out = {}
    for label, fields, state in PLANNED_CALLS:
        config = EchoConfig(**fields)
        plan = transports.plan_with(chosen, config, state_dtype=config.state_dtype if state
                                    else None, fallback=fallback)
        # The fallback's reason is printed once per axis already.
        out[label] = dataclasses.replace(plan, reasons=plan.reasons[fallback is not None:]
                                         ).describe()
    return out


def collect(axis_sizes=None) -> dict:
    """The doctor's findings, as a JSON-serialisable dict (`format_report` prints it).

    Args:
      axis_sizes: the axis sizes P to ask about (default: `default_axis_sizes`).

    Returns:
      {"platform", "devices", "process_count", "versions", "force_xla", "modules", "axes",
      "problems"}; "problems" counts the axes where "auto" falls back with a warning.
    """
    devices = list(jax.local_devices())
    platform = base.platform_name(devices[0].platform if devices else jax.default_backend())
    import jaxlib
    versions = {"python": _platform.python_version(), "echo_jax": echo_jax.__version__,
                "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "xla_ffi_api": _api(base.runtime_ffi_api()), "flax": _version("flax"),
                "jax_cuda_plugin": next(
                    (f"{name} {_version(name)}" for name in CUDA_PLUGINS if _version(name)),
                    None)}
    kinds = collections.Counter(str(getattr(d, "device_kind", d.platform)) for d in devices)
    sizes = (default_axis_sizes(len(devices)) if axis_sizes is None
             else tuple(int(s) for s in axis_sizes))
    axes = [_axis(size, platform, devices) for size in sizes]
    return {
        "platform": platform,
        "devices": [{"kind": k, "count": n} for k, n in kinds.items()],
        "local_device_count": len(devices),
        "process_count": jax.process_count(),
        "versions": versions,
        "force_xla": os.environ.get(transports.FORCE_XLA_ENV, "") not in ("", "0"),
        "modules": [_module("echo_jax._ffi", cpu), _module("echo_jax._ffi_cuda", cuda)],
        "axes": axes,
        "problems": sum(bool(a["warns"]) for a in axes),
    }


def _module_line(m: dict) -> str:
    if not m["built"]:
        return f"  {m['name']:<20} not built: {m['reason']}"
    parts = [f"headers of jaxlib {m['jaxlib']}", f"XLA FFI API {m['xla_ffi_api']}"]
    if "platforms" in m:
        parts.append(f"platforms {', '.join(m['platforms']) or 'none'}")
    if m.get("cuda", "unknown") != "unknown":
        parts.append(f"CUDA {m['cuda']}")
    if "cuda_architectures" in m:
        archs = m["cuda_architectures"]
        parts.append("CUDA architectures " + (archs if archs != "unknown" else
                                              "unknown (this build does not record them)"))
    status = "accepted by this jaxlib" if m["accepted"] else f"REFUSED: {m['reason']}"
    return f"  {m['name']:<20} built: {', '.join(parts)}; {status}"


def format_report(record: dict) -> str:
    """The doctor's findings (`collect`) as text."""
    v = record["versions"]
    devices = ", ".join(f"{d['count']} x {d['kind']}" for d in record["devices"]) or "none"
    n, procs = record["local_device_count"], record["process_count"]
    lines = [
        f"platform    {record['platform']}: {devices} ({n} local device{'s' * (n != 1)}, "
        f"{procs} process{'es' * (procs != 1)})",
        f"versions    echo_jax {v['echo_jax']}, jax {v['jax']}, jaxlib {v['jaxlib']} (XLA FFI API "
        f"{v['xla_ffi_api'] or 'unknown'}), flax {v['flax'] or 'not installed'}, "
        f"python {v['python']}, {v['jax_cuda_plugin'] or 'no jax CUDA plugin'}",
    ]
    if record["force_xla"]:
        lines.append(f"kill switch {transports.FORCE_XLA_ENV} is set: echo_psum runs 'xla' "
                     "everywhere, whatever follows")
    lines.append("modules")
    lines += [_module_line(m) for m in record["modules"]]
    lines.append('transport="auto" over one mesh axis of the first P local devices (echo_psum '
                 "inside a jax.shard_map manual over it, under jax.set_mesh):")
    reasons = {}
    shown = None  # the plans printed last: an axis with the same plans says so in one line
    for a in record["axes"]:
        head = f"  P={a['size']:<3} {a['transport'] or '-':<4}"
        if a["reason"] is None:
            lines.append(head.rstrip())
        elif a["transport"] is None:  # no such axis here
            lines.append(f"{head} {a['reason']}")
        else:
            reasons.setdefault(a["reason"], a["kind"])
            lines.append(f"{head} [{a['kind']}]" + ("  EchoFallbackWarning" if a["warns"] else ""))
        plans = a.get("plans") or {}
        if plans and plans == shown:
            lines[-1] += "  (plans as above)"
        else:
            lines += [f"        {label + ':':<30} {text}" for label, text in plans.items()]
            shown = plans
    if reasons:
        lines.append("why not the custom call (and the fix):")
        lines += [f"  [{kind}] {reason}" for reason, kind in reasons.items()]
    if record["problems"]:
        lines.append(f"{record['problems']} axis size(s) fall back to 'xla' with an "
                     "EchoFallbackWarning: fix the reason above to run the Echo custom call.")
    return "\n".join(lines)


__all__ = ["collect", "format_report", "default_axis_sizes", "DEFAULT_MAX_AXIS_SIZE"]
