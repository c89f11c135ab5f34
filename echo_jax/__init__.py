"""echo_jax: the Echo error-compensated 4-bit tensor-parallel all-reduce for JAX.

    import echo_jax as ej
    y = ej.echo_psum(x, "tp", config=ej.EchoConfig(bits=4))            # inside shard_map / vmap
    y, state = ej.echo_psum(x, "tp", config=cfg, state=ej.init_state(x))  # compensated
"""

from echo_jax.calibration import (choose_site_configs, parse_site_config, site_config_label,
                                  site_wire_bits)
from echo_jax.collective import echo_psum, resolve_transport, segment_layout
from echo_jax.compensator import CompensatorState, init_state
from echo_jax.config import EchoConfig
from echo_jax.quant import dequantize_groups, quantize_dequantize, quantize_groups
from echo_jax.rotation import hadamard_rotate, hadamard_signs, hadamard_unrotate

__version__ = "0.1.0"

__all__ = [
    "EchoConfig", "CompensatorState", "init_state", "echo_psum", "resolve_transport",
    "segment_layout", "quantize_groups", "dequantize_groups", "quantize_dequantize",
    "hadamard_rotate", "hadamard_unrotate", "hadamard_signs", "parse_site_config",
    "site_config_label", "site_wire_bits", "choose_site_configs",
]
