"""``python -m echo_jax_tools.update_floor``: the separate update alone against its byte floor.

Times the update of `EchoConfig.state_update="separate"` (x' from x, m1, m2; u = x' - y / P;
the two averages: the Echo paper Eqs. 4, 10, 11) on one GPU, two ways: the CUDA kernel
(`echo_jax.transports.cuda.update_state`, one pass) and the JAX reference
(`echo_jax.compensator.update_beside` on XLA's stream). The byte floor is what the update must
move (x and y read, m1 and m2 read and written) at the bandwidth of a device-to-device pass
timed the same way (read + write of a uint32 array). Each op runs ITERS times in one jitted
`lax.fori_loop` with the state as its donated carry (updated in place); the median of REPS loops.
Needs an NVIDIA GPU and the CUDA module (`echo_jax._ffi_cuda`).
"""

from __future__ import annotations

import argparse
import sys
import time

ITERS, REPS = 10, 5


def _bench(step, carry):
    import jax
    import numpy as np
    from jax import lax

    f = jax.jit(lambda c: lax.fori_loop(0, ITERS, lambda i, c: step(c), c), donate_argnums=0)
    carry = jax.block_until_ready(f(carry))
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        carry = jax.block_until_ready(f(carry))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / ITERS


def run(ranks: int, values: int) -> dict:
    """The rows (x dtype x state dtype) of the kernel and the reference against the floor."""
    import jax
    import jax.numpy as jnp

    import echo_jax as ej
    from echo_jax import compensator as comp
    from echo_jax.transports import cuda

    a = jnp.zeros((ranks * values,), jnp.uint32)
    bw = 2 * a.size * 4 / _bench(lambda a: a + jnp.uint32(1), a)
    rows = []
    for xdt in (jnp.bfloat16, jnp.float32):
        for sdt in ("float32", "bfloat16"):
            cfg = ej.EchoConfig(state_update="separate", state_dtype=sdt)
            k = comp.Coefficients.from_config(cfg)
            floor = ranks * values * (2 * jnp.dtype(xdt).itemsize + 4 * jnp.dtype(sdt).itemsize)

            def fresh():
                x = jax.random.normal(jax.random.key(0), (ranks, values)).astype(xdt)
                y = (ranks * x.astype(jnp.float32)).astype(xdt)
                z = jnp.zeros((ranks, values), sdt)
                return x, y, comp.CompensatorState(z, jnp.zeros_like(z) + 0)

            t_kernel = _bench(lambda c: (c[0], c[1], cuda.update_state(c[0], c[1], c[2], ranks,
                                                                       cfg)), fresh())
            t_jax = _bench(lambda c: (c[0], c[1], comp.update_beside(c[0], c[1], ranks, c[2],
                                                                     k, 0)), fresh())
            rows.append(dict(x_dtype=jnp.dtype(xdt).name, state_dtype=sdt, values=ranks * values,
                             floor_bytes=int(floor), copy_GBps=bw / 1e9,
                             kernel_ms=t_kernel * 1e3, kernel_vs_floor=t_kernel / (floor / bw),
                             jax_ms=t_jax * 1e3, jax_vs_floor=t_jax / (floor / bw)))
            r = rows[-1]
            print(f"x {r['x_dtype']:8} state {sdt:8}  kernel {r['kernel_ms']:7.3f} ms "
                  f"({r['kernel_vs_floor']:.2f}x floor)  jax {r['jax_ms']:7.3f} ms "
                  f"({r['jax_vs_floor']:.2f}x)  floor {floor / bw * 1e3:.3f} ms at "
                  f"{bw / 1e9:.0f} GB/s", flush=True)
    return dict(device=jax.devices()[0].device_kind, ranks=ranks, values_per_rank=values,
                rows=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m echo_jax_tools.update_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="virtual ranks P (default: %(default)s)")
    p.add_argument("--values", type=int, default=64 * 1024 * 1024,
                   help="values a rank (default: %(default)s, 128 MB of bf16)")
    p.add_argument("--json", help="write the rows, the command, commit and device here")
    args = p.parse_args(argv)
    record = run(args.ranks, args.values)
    if args.json:
        import jax

        from echo_jax._cli import write_json
        from echo_jax_tools import provenance
        made_by = provenance.record(provenance.command(
            "echo_jax_tools.update_floor", sys.argv[1:] if argv is None else argv),
            jax.devices()[:1])
        write_json(args.json, {**made_by, **record})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
