"""The CUDA custom call's public functions, kept under their old module name.

Their home is the transport `echo_jax.transports.cuda` (ffi/p2p_cuda.cu, ffi/quant_cuda.cu):
`rank_allreduce` (one rank per GPU inside `jax.shard_map`), `virtual_allreduce` (P rank
pipelines on one GPU, for tests and benchmarks), `quantize` / `dequantize` (the wire-format
kernels on their own). All of them return the same bits as the pure-JAX reference.
"""

from __future__ import annotations

from echo_jax.transports.cuda import (MAX_RANKS, POLICY_CODES, TIMEOUT_ENV,  # noqa: F401
                                      _module, available, build_info, dequantize, mesh_groups,
                                      quantize, rank_allreduce, register, timeout_ms,
                                      virtual_allreduce)

__all__ = ["available", "build_info", "register", "quantize", "dequantize", "virtual_allreduce",
           "rank_allreduce", "mesh_groups", "timeout_ms", "MAX_RANKS", "TIMEOUT_ENV",
           "POLICY_CODES"]
