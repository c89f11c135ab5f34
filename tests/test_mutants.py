"""The mutation check: each mutant of tests/mutants.py must make every one of its killer tests
fail.

A mutant is a real change of one library function, made in memory in a fresh pytest process
(``-p mutants`` with ``ECHO_JAX_MUTANT=<name>``); nothing on disk changes. The killers are the
tests that check a claim against an independent reference, so this shows that they can fail:
a test that passes on a broken implementation would be reported here. Without the mutant the
same tests pass (they are part of the suite).

Run one by hand:  ECHO_JAX_MUTANT=doubled_scale PYTHONPATH=tests \\
    python -m pytest -p mutants tests/echo_jax/test_quant.py
"""

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mutants import ENV, MUTANTS

REPO = Path(__file__).resolve().parents[1]
#: The mutation check runs with the slow set (`pytest -m slow`; CI runs both sets).
pytestmark = pytest.mark.slow

#: Mutant runs at a time (each is one single-threaded-ish pytest process; CI has 2 cores).
WORKERS = max(1, min(2, os.cpu_count() or 1))


def run_killers(name):
    env = dict(os.environ)
    env[ENV] = name
    # No compiled program from the parent run: a program's key does not see a C++ mutant.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"),
                                                      env.get("PYTHONPATH")]))
    # One process (the mutant is applied in this one), every killer, slow or not.
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:xdist", "-m", "slow or not slow",
           "-p", "mutants", "-p", "no:cacheprovider", *MUTANTS[name][2]]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def unavailable(name):
    """Why a mutant cannot be applied here (a C++ mutant needs a compiler), or None."""
    check = getattr(MUTANTS[name][1], "unavailable", None)
    return check() if check is not None else None


@pytest.fixture(scope="module")
def mutant_runs(request):
    """Start the selected mutants' runs, WORKERS at a time; name -> future."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_mutant_is_killed" and hasattr(item, "callspec")
             and unavailable(item.callspec.params["name"]) is None]
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        yield {name: pool.submit(run_killers, name) for name in names}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_killed(name, mutant_runs):
    what, _, killers = MUTANTS[name]
    reason = unavailable(name)
    if reason is not None:
        pytest.skip(reason)
    proc = mutant_runs[name].result()
    out = proc.stdout + proc.stderr
    assert f"mutant applied: {name}" in proc.stdout, out[-3000:]   # the plugin applied it
    failed = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED ")}
    survivors = [k for k in killers if k not in failed]
    assert proc.returncode == 1 and not survivors, (
        f"mutant {name!r} ({what}) survived {survivors} (pytest exit {proc.returncode}):\n"
        + out[-3000:])
