"""echo_jax_tools: the benchmarks, the multi-GPU projection and the toy demo of echo_jax.

    python -m echo_jax_tools.bench allreduce|gate|kernels|virtual|project ...   (bench)
    python -m echo_jax demo                                                       (demo)

* `echo_jax_tools.bench`: jit-compiled benchmarks of the Echo all-reduce and its kernels (the
  Echo paper's Table 2) and the size-gate threshold.
* `echo_jax_tools.projection`: the all-reduce time of P-GPU NVLink machines from the kernels'
  measured or modelled times (`python -m echo_jax_tools.bench project`).
* `echo_jax_tools.demo`: the toy residual stack of `python -m echo_jax demo` (per-site and
  accumulated all-reduce error per mode, the Echo paper's Eq. 5 and Eq. 6).

The tools import the library; the library never imports the tools (`python -m echo_jax demo`
loads `echo_jax_tools.demo` inside its handler), so `import echo_jax` stays free of them.
"""
