"""What a results JSON records of the run that wrote it: "command", "commit" and "device".

Every JSON under results/ carries these three top-level keys (tests/test_docs.py checks it):

    command  the invocation, "python -m <module> " + the arguments as a shell would take them
             (`command`; a flag naming a folder of the machine may be recorded as DIR)
    commit   the commit of the code that ran (`source_commit`: short hash, "-dirty" with
             uncommitted changes outside results/; None outside a git checkout of the project)
    device   what it ran on (`device_name`): the JAX device kind ("NVIDIA H200", "cpu"), with
             the count where the run used several ("cpu (8 devices)"); a run that computes
             nothing on a device says so in words (`bench project`: projection.NO_DEVICE)

Pure Python: it imports no JAX (the caller passes its devices).
"""

from __future__ import annotations

import collections
import os
import shlex
import subprocess
from collections.abc import Iterable, Sequence


def source_commit() -> str | None:
    """The commit of this code (short hash; "-dirty" with uncommitted changes to tracked files
    outside results/, which the runs write), or None where the module does not run from a git
    checkout of the project."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*cmd):
        return subprocess.run(["git", "-C", here, *cmd], capture_output=True, text=True,
                              timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode or not os.path.isdir(os.path.join(top.stdout.strip(),
                                                            "echo_jax_tools")) or \
                not os.path.samefile(os.path.join(top.stdout.strip(), "echo_jax_tools"), here):
            return None
        head = git("rev-parse", "--short=7", "HEAD")
        if head.returncode:
            return None
        dirty = git("diff", "--quiet", "HEAD", "--", ":(top)",
                    ":(top,exclude)results").returncode != 0
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def command(program: str, argv: Sequence | None, dir_flags: Iterable[str] = ()) -> str | None:
    """The command line of a run: "python -m <program> " + shlex.join(argv).

    Args:
      program: the module run, e.g. "echo_jax_tools.bench" (or "models.train plot").
      argv: the arguments without the program name (None: unknown, and so is the command).
      dir_flags: flags whose value is a folder of this machine: their value is recorded as DIR,
        in both forms ("--flag DIR", "--flag=DIR").
    """
    if argv is None:
        return None
    hidden, out, hide = frozenset(dir_flags), [], False
    for a in map(str, argv):
        flag = a.split("=", 1)[0]
        if hide:
            out.append("DIR")
        elif "=" in a and flag in hidden:
            out.append(flag + "=DIR")
        else:
            out.append(a)
        hide = a in hidden
    return " ".join(["python -m " + program] + ([shlex.join(out)] if out else []))


def device_name(devices: Sequence) -> str:
    """What a run computed on, from the JAX devices it used: the kind of one device
    ("NVIDIA H200", "cpu"); the kind, the platform where the kind does not name it, and the
    count of several ("cpu (8 devices)", "NVIDIA H100 80GB HBM3 (8 gpu devices)"); kinds
    joined by ", " where they differ.

    Args:
      devices: the devices (anything with `device_kind` and `platform`), at least one.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("device_name: no devices")
    counts = collections.Counter((str(d.device_kind), str(d.platform)) for d in devices)
    if len(devices) == 1:
        return str(devices[0].device_kind)
    parts = []
    for (kind, platform), n in counts.items():
        what = "devices" if platform.lower() in kind.lower() else f"{platform} devices"
        parts.append(f"{kind} ({n} {what})" if n > 1 else f"{kind} (1 {what[:-1]})")
    return ", ".join(parts)


def record(command_line: str | None, devices) -> dict:
    """{"command", "commit", "device"} of a run, the first keys of its results JSON.

    Args:
      command_line: `command(...)` of the run.
      devices: the JAX devices the run used (`device_name`), or the device as a string.
    """
    return {"command": command_line, "commit": source_commit(),
            "device": devices if isinstance(devices, str) else device_name(devices)}


__all__ = ["command", "device_name", "record", "source_commit"]
