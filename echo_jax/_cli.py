"""Command-line helpers shared by every echo_jax and models CLI.

One home for what the command lines need before and after JAX starts: fake CPU devices
(`request_host_devices`), the atomic JSON writer (`write_json`), message-size parsing and
formatting (`parse_size`, `parse_sizes`, `format_size`) and the positive-integer argparse type.
Nothing here imports JAX: `request_host_devices` must run before the first device query.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}

# Named size lists of the benchmarks.
SIZE_ALIASES = {"small": "64KB,256KB,1MB,4MB,16MB", "large": "64MB,256MB,1GB"}


# --------------------------------------------------------------------------------------------
# Devices (before JAX starts)


def request_host_devices(count: int, minimum: int = 8) -> None:
    """Ask XLA for max(count, minimum) CPU devices, unless the user already decided.

    XLA reads XLA_FLAGS when its first backend starts (not at ``import jax``), so a CLI may
    import JAX at the top and call this in main() before anything touches a device; called
    after a backend started, the request has no effect (the model runners then simulate the
    ranks). The request is appended to any existing XLA_FLAGS and is left out when XLA_FLAGS
    already sets a device count (the user's choice) or when JAX_PLATFORMS excludes the CPU.
    Only the host platform reads the flag, so it is harmless on a GPU machine.

    Args:
      count: devices wanted (e.g. the ranks P).
      minimum: the least number to ask for (the echo_jax commands ask for 8, the models CLIs
        for exactly P).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if DEVICE_COUNT_FLAG in flags:
        return
    if platforms and "cpu" not in platforms.split(","):
        return
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={max(count, minimum, 1)}".strip()


# --------------------------------------------------------------------------------------------
# Output


def write_json(path, record: dict, indent: int = 1) -> None:
    """Write `record` as JSON atomically: a temporary file in the same folder, then a rename.

    A reader never sees half a file, and a run cut off while writing keeps the previous one.

    Args:
      path: the output file (str or Path); its folder is created.
      record: a JSON-serialisable dict.
      indent: the JSON indentation.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=indent)
            f.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> the mode of a plain open()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------
# Argument types


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_size(text: str) -> int:
    """Bytes of a size such as "64KB", "1.5MB", "1GB" or "4096".

    Args:
      text: a number with an optional KB / MB / GB suffix (powers of 1024).

    Returns:
      The size in bytes.
    """
    text = text.strip().upper()
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def parse_sizes(text: str) -> list:
    """Sorted distinct sizes of a comma list of sizes and aliases ("small", "large").

    Args:
      text: e.g. "small,large", "64MB,1GB" or "small,256MB".

    Returns:
      The sizes in bytes, ascending.
    """
    sizes = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() in SIZE_ALIASES:
            sizes.update(parse_size(s) for s in SIZE_ALIASES[item.lower()].split(","))
            continue
        try:
            size = parse_size(item)
        except ValueError:
            raise ValueError(f"bad size {item!r}: use e.g. 64KB, 16MB, 1GB or one of "
                             f"{sorted(SIZE_ALIASES)}") from None
        if size <= 0:
            raise ValueError(f"sizes must be positive, got {item!r}")
        sizes.add(size)
    if not sizes:
        raise ValueError("no sizes given")
    return sorted(sizes)


def format_size(nbytes: int) -> str:
    """"64KB", "1MB", "1GB", or plain bytes when not a whole number of KB."""
    for unit, mult in sorted(UNITS.items(), key=lambda kv: -kv[1]):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return f"{nbytes}B"
