"""One uncompensated and one compensated 4-bit virtual-rank all-reduce (P = 4, 64 MiB a rank),
for profiling the fused kernel with ncu (ffi/tools/quant_stages.cu covers the quantizer)."""
import jax
import jax.numpy as jnp

import echo_jax as ej
from echo_jax import p2p_cuda

cfg = ej.EchoConfig(bits=4)
x = jax.random.normal(jax.random.key(0), (4, 16 << 20), jnp.float32)
jax.block_until_ready(p2p_cuda.virtual_allreduce(x, cfg))
jax.block_until_ready(p2p_cuda.virtual_allreduce(x, cfg, ej.init_state(x)))
print("done")
