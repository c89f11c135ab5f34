"""Model and communication configs of the tensor-parallel transformer, and named presets.

`ModelConfig` describes the architecture (Qwen3 / Llama family); `CommConfig` says how the
tensor-parallel sites communicate: the TP degree P, the mesh / vmap axis name, and the Echo
settings (None = the exact 16-bit `lax.psum` baseline). Both are frozen and hashable, so they can
be static arguments of `jax.jit`. Every bad value raises a ValueError naming the field and value.

Presets (`PRESETS`, `get_config(name, **overrides)`) and the TP degrees P each supports
(P must divide n_heads, n_kv_heads and ffn_dim; see `supported_tp`):

    tiny          2 layers, dim 64, 24 heads / 12 KV heads   P in {1, 2, 3, 4, 6, 12}    tests
    small         8 layers, dim 512, 8 / 4 heads, vocab 49152  P in {1, 2, 4}           experiments
    smollm2-135m  30 layers, dim 576, 9 / 3 heads (Llama)     P in {1, 3}
    qwen3-0.6b    28 layers, dim 1024, 16 / 8 heads          P in {1, 2, 4, 8}
    qwen3-8b      36 layers, dim 4096, 32 / 8 heads          P in {1, 2, 4, 8}
    llama3-8b     32 layers, dim 4096, 32 / 8 heads          P in {1, 2, 4, 8}
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from echo_jax import tp as tp_ops
from echo_jax.config import EchoConfig

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
PARAM_DTYPES = ("float32", "bfloat16")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Qwen3 when qk_norm, Llama otherwise).

    Args:
      vocab_size: number of token ids V.
      dim: width of the residual stream D.
      n_layers: number of decoder layers L.
      n_heads: query heads H.
      n_kv_heads: key/value heads (grouped-query attention; divides n_heads).
      head_dim: width of one head (even, for RoPE); H * head_dim need not equal D (Qwen3).
      ffn_dim: hidden width F of the SwiGLU MLP.
      rope_base: RoPE frequency base theta.
      norm_eps: RMSNorm epsilon.
      qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3: True, Llama: False).
      tie_embeddings: the LM head is the transposed token embedding.
      max_seq_len: longest sequence (positions 0 .. max_seq_len - 1) the model accepts.
      dtype: compute dtype of activations and matmuls ("float32", "bfloat16", "float16").
      param_dtype: storage dtype of the parameters ("float32" or "bfloat16").
      name: free-form label (presets use their own name).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = True
    max_seq_len: int = 2048
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    name: str = "custom"

    def __post_init__(self):
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "ffn_dim", "max_seq_len"):
            v = getattr(self, f)
            if not _is_int(v) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide "
                             f"n_heads={self.n_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE rotates pairs), "
                             f"got {self.head_dim}")
        if not _is_real(self.rope_base) or self.rope_base <= 1:
            raise ValueError(f"ModelConfig.rope_base must be a number > 1, got {self.rope_base!r}")
        if not _is_real(self.norm_eps) or not 0 < self.norm_eps < 1:
            raise ValueError(f"ModelConfig.norm_eps must be in (0, 1), got {self.norm_eps!r}")
        for f in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"ModelConfig.{f} must be a bool, got {getattr(self, f)!r}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {COMPUTE_DTYPES}, "
                             f"got {self.dtype!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"ModelConfig.param_dtype must be one of {PARAM_DTYPES}, "
                             f"got {self.param_dtype!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"ModelConfig.name must be a str, got {self.name!r}")

    @property
    def q_dim(self) -> int:
        """Width of all query heads, H * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads, n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Number of parameters of the full (unsharded) model."""
        d, l = self.dim, self.n_layers
        per_layer = (d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d  # attention
                     + 3 * d * self.ffn_dim + 2 * d                          # MLP, two norms
                     + (2 * self.head_dim if self.qk_norm else 0))
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + l * per_layer + d + head


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """How the tensor-parallel sites communicate.

    Args:
      tp: tensor-parallel degree P (ranks of the "tp" axis; 1 = no communication).
      axis_name: name of the shard_map mesh axis or the vmap axis of the ranks.
      echo: the Echo all-reduce settings at every site, or None for the exact 16-bit baseline
        (`lax.psum` through the same code path).
      early_8bit: the early-site policy of the Echo paper Sec. 7.2: layers in the first half run
        at 8 bits, the rest at `echo.bits` (needs `echo`).
      compensate_forward: thread the compensator state through the forward sites (g). Off means
        the forward sites run uncompensated (as if echo.eta were 0 there).
      compensate_backward: the same for the backward sites (f).
    """

    tp: int = 1
    axis_name: str = "tp"
    echo: Optional[EchoConfig] = None
    early_8bit: bool = False
    compensate_forward: bool = True
    compensate_backward: bool = True

    def __post_init__(self):
        if not _is_int(self.tp) or self.tp <= 0:
            raise ValueError(f"CommConfig.tp must be a positive int, got {self.tp!r}")
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise ValueError(f"CommConfig.axis_name must be a non-empty str, "
                             f"got {self.axis_name!r}")
        if self.echo is not None and not isinstance(self.echo, EchoConfig):
            raise ValueError(f"CommConfig.echo must be an EchoConfig or None (exact), "
                             f"got {self.echo!r}")
        for f in ("early_8bit", "compensate_forward", "compensate_backward"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"CommConfig.{f} must be a bool, got {getattr(self, f)!r}")
        if self.early_8bit and self.echo is None:
            raise ValueError("CommConfig.early_8bit=True needs an Echo config "
                             "(CommConfig.echo is None: the exact baseline has no bits to choose)")

    def replace(self, **changes) -> "CommConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def exact(self) -> bool:
        """Whether the sites use the exact `lax.psum` (no Echo)."""
        return self.echo is None

    def _site_configs(self, compensate: bool):
        if self.echo is None:
            return None
        cfg = self.echo if compensate else self.echo.replace(eta=0.0)
        return tp_ops.early_8bit_configs(cfg) if self.early_8bit else cfg

    def forward_configs(self):
        """Site config(s) of the forward sites g: None, an EchoConfig, or (8-bit, n-bit)."""
        return self._site_configs(self.compensate_forward)

    def backward_configs(self):
        """Site config(s) of the backward sites f: None, an EchoConfig, or (8-bit, n-bit)."""
        return self._site_configs(self.compensate_backward)

    def layer_choice(self, layer, n_layers: int):
        """Index into the site-config tuple for layer `layer` (traced ok); None without one."""
        if not self.early_8bit:
            return None
        return tp_ops.early_8bit_choice(layer, n_layers)

    def describe(self) -> str:
        """A short label, e.g. "P=4 echo 4-bit comp" or "P=4 exact"."""
        if self.echo is None:
            return f"P={self.tp} exact"
        e = self.echo
        comp = "comp" if e.compensated and (self.compensate_forward or
                                            self.compensate_backward) else "nocomp"
        bits = f"8/{e.bits}-bit" if self.early_8bit else f"{e.bits}-bit"
        return f"P={self.tp} echo {bits} {comp}"


def check_tp(model: ModelConfig, tp: int) -> None:
    """Raise a ValueError naming the field if `model` cannot be split over `tp` ranks.

    Megatron's layout gives every rank n_heads / P query heads, n_kv_heads / P key/value heads
    and ffn_dim / P MLP columns, so P must divide all three.
    """
    if not _is_int(tp) or tp <= 0:
        raise ValueError(f"tensor-parallel degree must be a positive int, got {tp!r}")
    for f in ("n_heads", "n_kv_heads", "ffn_dim"):
        v = getattr(model, f)
        if v % tp:
            raise ValueError(
                f"ModelConfig.{f}={v} is not divisible by the tensor-parallel degree P={tp}; "
                f"{model.name!r} supports P in {supported_tp(model)}")


def supported_tp(model: ModelConfig, max_tp: int = 64) -> tuple:
    """The TP degrees P <= max_tp that divide n_heads, n_kv_heads and ffn_dim."""
    return tuple(p for p in range(1, max_tp + 1)
                 if model.n_heads % p == 0 and model.n_kv_heads % p == 0
                 and model.ffn_dim % p == 0)


PRESETS = {
    # CPU tests: 24 query heads in 12 KV groups of 2, so P = 2, 3 and 4 all split it.
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=24, n_kv_heads=12,
                        head_dim=8, ffn_dim=192, rope_base=10000.0, norm_eps=1e-6,
                        qk_norm=True, tie_embeddings=False, max_seq_len=128,
                        dtype="float32", name="tiny"),
    # One-GPU experiments at simulated P = 4 (SmolLM2 tokenizer vocabulary).
    "small": ModelConfig(vocab_size=49152, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                         head_dim=64, ffn_dim=1536, rope_base=10000.0, norm_eps=1e-6,
                         qk_norm=True, tie_embeddings=True, max_seq_len=512,
                         dtype="bfloat16", name="small"),
    # HuggingFaceTB/SmolLM2-135M(-Instruct): Llama architecture. fp32 compute (CPU evaluation).
    "smollm2-135m": ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9,
                                n_kv_heads=3, head_dim=64, ffn_dim=1536, rope_base=100000.0,
                                norm_eps=1e-5, qk_norm=False, tie_embeddings=True,
                                max_seq_len=8192, dtype="float32", name="smollm2-135m"),
    # Qwen/Qwen3-0.6B (max_position_embeddings 40960).
    "qwen3-0.6b": ModelConfig(vocab_size=151936, dim=1024, n_layers=28, n_heads=16,
                              n_kv_heads=8, head_dim=128, ffn_dim=3072, rope_base=1000000.0,
                              norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
                              max_seq_len=40960, dtype="bfloat16", name="qwen3-0.6b"),
    # Qwen/Qwen3-8B.
    "qwen3-8b": ModelConfig(vocab_size=151936, dim=4096, n_layers=36, n_heads=32,
                            n_kv_heads=8, head_dim=128, ffn_dim=12288, rope_base=1000000.0,
                            norm_eps=1e-6, qk_norm=True, tie_embeddings=False,
                            max_seq_len=40960, dtype="bfloat16", name="qwen3-8b"),
    # meta-llama/Meta-Llama-3-8B (no RoPE scaling; Llama 3.1's "llama3" scaling is not built in).
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_base=500000.0,
                             norm_eps=1e-5, qk_norm=False, tie_embeddings=False,
                             max_seq_len=8192, dtype="bfloat16", name="llama3-8b"),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, with some fields overridden (e.g. `dtype="float32"`).

    Args:
      name: a key of `PRESETS`.
      **overrides: ModelConfig fields to change.

    Returns:
      The validated ModelConfig.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


__all__ = ["ModelConfig", "CommConfig", "check_tp", "supported_tp", "PRESETS", "get_config",
           "COMPUTE_DTYPES", "PARAM_DTYPES"]
