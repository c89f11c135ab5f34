"""Test setup: 8 fake CPU devices (before JAX starts), GPU marker, mesh helpers."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_mesh(shape, names):
    """A mesh over the first prod(shape) devices (Auto axes: inputs may arrive unsharded)."""
    n = int(np.prod(shape))
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))
