"""The shared command line of the models CLIs (train, eval, generate, calibrate, experiments,
bench_e2e): one set of flags and one meaning for each.

* Devices: `ensure_host_devices` asks XLA for P fake CPU devices before the first device query
  (`echo_jax._cli.request_host_devices`; XLA reads XLA_FLAGS when its backend starts, not at
  ``import jax``, so the CLIs import JAX at the top). `--simulate` (`add_simulate_arg`) forces the
  vmap simulation of the P ranks on one device; without it the ranks run under shard_map over
  the first P devices when there are that many, else simulated (`make_mesh`).
* Communication: `add_comm_args` (--tp, --simulate, --bits, --policy, --site-bits, ...),
  `comm_from_args` -> CommConfig, `comm_to_dict` for the JSON records.
* Checkpoint flags: `add_model_args` (--checkpoint, --step, --dtype, --tokenizer, --cache-dir);
  the loading itself is `models.checkpoints`.
* Output: `write_json` (atomic); `recorded_command` and `run_provenance`, the "command",
  "commit" and "device" every results JSON starts with.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from echo_jax import policies
from echo_jax._cli import request_host_devices, write_json
from echo_jax.config import EchoConfig
from echo_jax_tools import provenance
from models import model as M
from models.config import CommConfig, load_site_policy

POLICIES = policies.NAMES
TRANSPORTS = ("auto", "p2p", "xla")
DTYPES = ("float32", "bfloat16", "float16")

SIMULATE_HELP = ("simulate the P ranks with jax.vmap on one device. Default: on when there are "
                 "fewer than P devices, else shard_map over the first P.")


#: Flags whose value is a folder of this machine: a results JSON records DIR in their place.
LOCAL_DIR_FLAGS = ("--cache-dir", "--checkpoint-dir", "--shakespeare-dir", "--tokens")


def recorded_command(program: str, argv) -> str:
    """A run's command line as its results JSON records it: `python -m <program>` and the
    arguments (`echo_jax_tools.provenance.command`), the value of each local-folder flag
    (`LOCAL_DIR_FLAGS`) written as DIR.

    Args:
      program: the module run, e.g. "models.train".
      argv: the arguments as given (`sys.argv[1:]`).
    """
    return provenance.command(program, argv, LOCAL_DIR_FLAGS)


def run_provenance(command: str | None, mesh) -> dict:
    """{"command", "commit", "device"} of a run, the first keys of its results JSON
    (`echo_jax_tools.provenance.record`).

    Args:
      command: `recorded_command(...)` of the run.
      mesh: the mesh of `make_mesh` (its devices), or None: the vmap simulation on the default
        device.
    """
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    return provenance.record(command, devices)


def ensure_host_devices(n: int) -> None:
    """Ask XLA for `n` CPU devices (the ranks P) unless XLA_FLAGS already sets a count.

    Args:
      n: the tensor-parallel degree P.
    """
    request_host_devices(n, minimum=1)


def add_simulate_arg(group, default: bool = False) -> None:
    """Add --simulate (force the vmap simulation of the P ranks) to a parser or group.

    Args:
      group: an argparse parser or argument group.
      default: True for a CLI whose runs simulate unless told otherwise (the studies of
        `models.experiments`, whose committed results were simulated); it then also takes
        --no-simulate (shard_map over P devices).
    """
    if default:
        group.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=True,
                           help="simulate the P ranks with jax.vmap on one device (default); "
                                "--no-simulate runs them under shard_map over P devices")
    else:
        group.add_argument("--simulate", action="store_true", help=SIMULATE_HELP)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Add --checkpoint, --step, --dtype, --tokenizer, --cache-dir to `parser`."""
    g = parser.add_argument_group("checkpoint")
    g.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="an HF folder (config.json + *.safetensors), a .gguf file, a directory "
                        "written by models.train, or 'smollm2' (the installed SmolLM2 GGUF)")
    g.add_argument("--step", type=int,
                   help="step of a models.train directory to load (default: the latest)")
    g.add_argument("--dtype", choices=DTYPES,
                   help="compute dtype (default: the checkpoint's; GGUF: float32)")
    g.add_argument("--tokenizer", metavar="SPEC",
                   help="tokenizer instead of the checkpoint's own: 'smollm2', a .gguf file or "
                        "an EchoTokenizer JSON")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="echo_jax cache root (default $ECHO_JAX_CACHE or ~/.cache/echo_jax)")


def add_comm_args(parser: argparse.ArgumentParser, default_bits: int = 16) -> None:
    """Add the tensor-parallel / Echo flags (--tp, --bits, --policy, ...) to `parser`.

    Args:
      parser: the argparse parser.
      default_bits: the default of --bits.
    """
    g = parser.add_argument_group("tensor parallelism and Echo")
    g.add_argument("--tp", type=int, default=1, metavar="P",
                   help="tensor-parallel degree P: the ranks each hold 1/P of the heads and MLP "
                        "columns (P must divide n_heads, n_kv_heads and ffn_dim). Default 1.")
    add_simulate_arg(g)
    g.add_argument("--bits", type=int, choices=(16, 8, 4), default=default_bits,
                   help="bits per value on the wire at every TP all-reduce: 16 = the exact "
                        f"lax.psum baseline, 8 or 4 = Echo. Default {default_bits}.")
    g.add_argument("--no-compensation", action="store_true",
                   help="run Echo without the error-feedback compensator (eta = 0)")
    g.add_argument("--policy", choices=POLICIES, default="asym",
                   help="quantization policy: asym (zero-aware asymmetric, the default), sym, "
                        "or asym_naive (ablation)")
    g.add_argument("--early-8bit", action="store_true",
                   help="run the first half of the layers at 8 bits and the rest at --bits "
                        "(the early-site policy of the Echo paper Sec. 7.2)")
    g.add_argument("--group-size", type=int, default=128, metavar="G",
                   help="values per quantization group (one bf16 scale [+ fp16 zero-point] each). "
                        "Default 128.")
    g.add_argument("--eta", type=float, default=0.75,
                   help="compensator gain eta in [0, 1] (0 = no compensation). Default 0.75.")
    g.add_argument("--rotation", choices=("none", "hadamard"), default="none",
                   help="hadamard: rotate each quantization group by a randomized Hadamard "
                        "matrix before quantizing (same wire cost; needs a power-of-two "
                        "--group-size). Default none.")
    g.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="Echo transport: auto (the custom call where it can run, else XLA), "
                        "xla, or p2p. Simulated ranks always use xla.")
    g.add_argument("--state-dtype", choices=("float32", "bfloat16", "int8", "int4"),
                   default="float32",
                   help="storage dtype of the compensator state m1, m2 (computed in fp32 "
                        "either way; bfloat16 rounds the stored state to nearest even; int8 / "
                        "int4: codes and a power-of-two scale a 128 values; needs --group-size "
                        "128; int4 is meant for --residual local). Default float32.")
    g.add_argument("--state-update", choices=("in_call", "separate"), default="in_call",
                   help="where the compensator's update runs: in_call (inside the all-reduce) "
                        "or separate (its own op after it, on a second GPU stream beside the "
                        "next matrix multiplication). Default in_call.")
    g.add_argument("--residual", choices=("output", "local"), default="output",
                   help="the residual the compensator averages: output (u = x' - y / P, the "
                        "Echo paper's) or local (each rank's own rounding errors, updated where "
                        "the call quantizes; needs --state-update in_call and no rotation). "
                        "Default output.")
    g.add_argument("--site-bits", metavar="FILE",
                   help="per-site precision: a site-policy JSON (written by python -m "
                        "models.calibrate) giving every all-reduce site its own bits / group "
                        "size / rotation; replaces --bits, --group-size, --policy, --eta and "
                        "--rotation "
                        "(--no-compensation and --transport still apply)")


def comm_from_args(args):
    """The CommConfig of the parsed comm flags (a ValueError names a bad value)."""
    site_bits = getattr(args, "site_bits", None)
    if site_bits:
        if args.early_8bit:
            raise ValueError("--site-bits and --early-8bit are exclusive (the policy file gives "
                             "every site its bits)")
        try:
            policy = load_site_policy(site_bits, transport=args.transport)
        except FileNotFoundError as err:
            raise ValueError(f"--site-bits: {err}") from None
        sd = getattr(args, "state_dtype", "float32")
        su = getattr(args, "state_update", "in_call")
        res = getattr(args, "residual", "output")
        if sd != "float32" or su != "in_call" or res != "output":
            policy = dataclasses.replace(policy, configs=tuple(
                None if c is None else c.replace(state_dtype=sd, state_update=su, residual=res)
                for c in policy.configs))
        on = not args.no_compensation
        return CommConfig(tp=args.tp, site_policy=policy, compensate_forward=on,
                          compensate_backward=on)
    if args.bits == 16:
        if args.early_8bit:
            raise ValueError("--early-8bit needs --bits 4 (the exact 16-bit baseline has no "
                             "bits to choose)")
        return CommConfig(tp=args.tp)
    eta = 0.0 if args.no_compensation else args.eta
    echo = EchoConfig(bits=args.bits, group_size=args.group_size, policy=args.policy, eta=eta,
                      transport=args.transport, rotation=getattr(args, "rotation", "none"),
                      state_dtype=getattr(args, "state_dtype", "float32"),
                      state_update=getattr(args, "state_update", "in_call"),
                      residual=getattr(args, "residual", "output"))
    return CommConfig(tp=args.tp, echo=echo, early_8bit=args.early_8bit)


def comm_to_dict(comm) -> dict:
    """A JSON-able description of a CommConfig (a site policy: its JSON object, bits None)."""
    out = {"tp": comm.tp, "bits": 16 if comm.exact else (None if comm.echo is None
                                                          else comm.echo.bits),
           "echo": None if comm.echo is None else dataclasses.asdict(comm.echo),
           "early_8bit": comm.early_8bit, "label": comm.describe()}
    if comm.site_policy is not None:
        out["site_policy"] = {"file": comm.site_policy.name, **comm.site_policy.to_dict()}
        out["compensate"] = comm.compensate_forward
    return out


def make_mesh(comm, simulate: bool):
    """Choose shard_map over real devices or vmap simulation.

    Args:
      comm: the CommConfig (P = comm.tp).
      simulate: force the vmap simulation.

    Returns:
      (mesh or None, a short description such as "shard_map on 4 cpu devices").
    """
    devices = jax.devices()
    if simulate or len(devices) < comm.tp:
        why = "requested" if simulate else f"{len(devices)} device(s) < P={comm.tp}"
        return None, f"vmap simulation of P={comm.tp} ranks on {devices[0].platform} ({why})"
    mesh = Mesh(np.array(devices[:comm.tp]), (comm.axis_name,))
    return mesh, f"shard_map over {comm.tp} {devices[0].platform} device(s)"


def place(tree, mesh, comm):
    """Put a stacked [P, ...] pytree on the device(s): the mesh, or the default device."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    return M.place_params(tree, mesh, comm)


def load_token_dir(path: str):
    """Token arrays prepared by models.data (its ``<cache>/tokens/<key>/`` directory).

    Returns:
      (train tokens, held-out tokens, meta dict), arrays memory-mapped.
    """
    p = Path(path)
    for f in ("train.npy", "heldout.npy", "meta.json"):
        if not (p / f).is_file():
            raise ValueError(f"--tokens {path}: no {f} (expected a models.data token directory)")
    return (np.load(p / "train.npy", mmap_mode="r"), np.load(p / "heldout.npy", mmap_mode="r"),
            json.loads((p / "meta.json").read_text()))


__all__ = ["DTYPES", "LOCAL_DIR_FLAGS", "POLICIES", "TRANSPORTS", "add_comm_args", "add_model_args",
           "add_simulate_arg", "comm_from_args", "comm_to_dict", "ensure_host_devices",
           "load_token_dir", "make_mesh", "place", "recorded_command", "run_provenance",
           "write_json"]
