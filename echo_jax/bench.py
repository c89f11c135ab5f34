"""Jit-compiled benchmarks of the Echo kernels and of the all-reduce on virtual ranks.

    python -m echo_jax.bench kernels  [--sizes 64MB,256MB] [--json OUT]
    python -m echo_jax.bench virtual  [--ranks 4] [--sizes 16MB,256MB] [--json OUT]

Timing: each measured op runs `--iters` times inside one jitted `lax.fori_loop`, chained through
an optimization barrier so XLA can neither hoist nor drop it; the loop is timed with the wall
clock after a warm-up run and `block_until_ready`, and the per-call time is the loop time divided
by the iterations (the median over `--repeats` loops). Dispatch costs are thus amortised over the
loop; the numbers are device time plus the loop's own (negligible) bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for unit, mult in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def time_op(fn, x, iters: int, repeats: int, warmup: int = 1) -> float:
    """Median seconds per call of fn(x) (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    out_shape = jax.eval_shape(fn, x)

    def body(_, carry):
        v, _ = carry
        # The whole output is carried, so XLA must compute all of it; the barrier makes the next
        # input depend on it, so nothing is hoisted out of the loop.
        return lax.optimization_barrier((v, fn(v)))

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    loop = jax.jit(lambda v: jax.tree.leaves(lax.fori_loop(0, iters, body, (v, zeros))[1])[0])
    for _ in range(max(1, warmup)):
        loop(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop(x).block_until_ready()
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def bench_kernels(args) -> dict:
    import jax
    import jax.numpy as jnp
    import echo_jax as ej
    from echo_jax import p2p_cuda

    rows = []
    for size in args.sizes:
        n = size // 4
        n -= n % 128
        x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
        copy_s = time_op(lambda v: v * 2.0, x, args.iters, args.repeats)
        copy_bw = 8 * n / copy_s  # read 4 B + write 4 B per value
        rows.append(dict(op="copy (x*2)", dtype="float32", size_bytes=size, seconds=copy_s,
                         bytes_moved=8 * n, gbps=copy_bw / 1e9, pct_of_copy=100.0))
        for bits in (4, 8):
            cfg = ej.EchoConfig(bits=bits)
            wire = n // 128 * (128 * bits // 8 + 4)
            for dtype in (jnp.float32, jnp.bfloat16):
                xd = x.astype(dtype)
                q_s = time_op(lambda v: p2p_cuda.quantize(v, cfg), xd, args.iters, args.repeats)
                moved = n * jnp.dtype(dtype).itemsize + wire
                rows.append(dict(op=f"quantize {bits}-bit", dtype=jnp.dtype(dtype).name,
                                 size_bytes=size, seconds=q_s, bytes_moved=moved,
                                 gbps=moved / q_s / 1e9, pct_of_copy=100 * moved / q_s / copy_bw))
            packed, params = jax.jit(lambda v: p2p_cuda.quantize(v, cfg))(x)
            d_s = time_op(lambda p: p2p_cuda.dequantize(p[0], p[1], cfg), (packed, params),
                          args.iters, args.repeats)
            moved = wire + 4 * n
            rows.append(dict(op=f"dequantize {bits}-bit", dtype="float32", size_bytes=size,
                             seconds=d_s, bytes_moved=moved, gbps=moved / d_s / 1e9,
                             pct_of_copy=100 * moved / d_s / copy_bw))
    return {"benchmark": "kernels", "device": str(jax.devices()[0].device_kind), "rows": rows}


def bench_virtual(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import echo_jax as ej
    from echo_jax import compensator as comp
    from echo_jax import p2p_cuda

    P = args.ranks
    rows = []
    for size in args.sizes:
        n = size // 4
        x = jax.random.normal(jax.random.key(1), (P, n), jnp.float32)
        state = ej.init_state(x)
        exact = np.asarray(x, np.float64).sum(0)

        def xla(v, bits):
            cfg = ej.EchoConfig(bits=bits, transport="xla")
            return jax.vmap(lambda r: ej.echo_psum(r, "tp", config=cfg), axis_name="tp")(v)

        def p2p(v, bits):
            return p2p_cuda.virtual_allreduce(v, ej.EchoConfig(bits=bits))

        def fused(v):
            return p2p_cuda.virtual_allreduce(v, ej.EchoConfig(bits=4), state)

        def unfused(v):
            # The compensator as separate jnp passes around the uncompensated custom call.
            cfg = ej.EchoConfig(bits=4)
            k = comp.Coefficients.from_config(cfg)
            xp = comp.apply_correction(v, state, k)
            y = p2p_cuda.virtual_allreduce(xp, cfg)
            return y, comp.update_state(xp, y, P, state, k)

        cases = [("xla 8-bit", lambda v: xla(v, 8)), ("xla 4-bit", lambda v: xla(v, 4)),
                 ("p2p 8-bit", lambda v: p2p(v, 8)), ("p2p 4-bit", lambda v: p2p(v, 4)),
                 ("p2p 4-bit comp unfused", unfused), ("p2p 4-bit comp fused", fused)]
        base = None
        for name, fn in cases:
            s = time_op(fn, x, args.iters, args.repeats)
            y = np.asarray(jax.tree.leaves(jax.jit(fn)(x))[0])
            if name == "xla 4-bit":
                base = s
            rows.append(dict(row=name, size_bytes=size, ranks=P, median_s=s,
                             max_abs_err=float(np.abs(y[0] - exact).max()),
                             bit_identical_across_ranks=bool((y == y[0]).all())))
        for r in rows:
            if r["size_bytes"] == size:
                r["speedup_vs_xla4"] = base / r["median_s"]
    return {"benchmark": "virtual", "ranks": P, "device": str(jax.devices()[0].device_kind),
            "note": "P virtual ranks share one GPU: no NVLink, all traffic is local HBM; "
                    "not representative of a multi-GPU all-reduce", "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo_jax.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, default in (("kernels", "64MB,256MB"), ("virtual", "16MB,256MB")):
        p = sub.add_parser(name)
        p.add_argument("--sizes", default=default, help="message sizes per rank, e.g. 64MB,1GB")
        p.add_argument("--iters", type=int, default=30)
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--json", help="write the results to this file")
        if name == "virtual":
            p.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    result = bench_kernels(args) if args.cmd == "kernels" else bench_virtual(args)
    for row in result["rows"]:
        print(json.dumps(row))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
