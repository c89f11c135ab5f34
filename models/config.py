"""Model and communication configs of the tensor-parallel transformer, and named presets.

`ModelConfig` describes the architecture (Qwen3 / Llama family); `CommConfig` says how the
tensor-parallel sites communicate: the TP degree P, the mesh / vmap axis name, and the Echo
settings (None = the exact 16-bit `lax.psum` baseline). Both are frozen and hashable, so they can
be static arguments of `jax.jit`. Every bad value raises a ValueError naming the field and value.

Per-site precision: `SitePolicy` gives each of the 2 L forward sites (and optionally the 2 L
backward sites) its own config, as a table of indices into a tuple of distinct EchoConfigs (None
= exact 16-bit); `CommConfig(site_policy=...)` runs it. The early-site 8-bit policy of the Echo
paper Sec. 7.2 is `SitePolicy.early_8bit`. Policies are stored as small JSON files
(`SitePolicy.save`, `load_site_policy`; written by `python -m models.calibrate`):

    {"format": "echo_jax.site_policy/1", "model": "smollm2-135m", "tp": 3, "n_layers": 30,
     "configs": [{"bits": 4, "group_size": 128, "policy": "asym", "rotation": "none",
                  "eta": 0.75, ...}, {"bits": 8, ...}, null],
     "forward": [[0, 1], [0, 0], ...],          # per layer: [attention site, MLP site]
     "backward": null,                          # null: the backward sites follow "forward"
     "wire_bits_per_element": 4.5, "calibration": {...}}

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
import json
import numbers
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from echo_jax import tp as tp_ops
from echo_jax._cli import write_json
from echo_jax.calibration import site_config_label, site_wire_bits
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


# --------------------------------------------------------------------------------------------
# Per-site precision


#: Version tag of the site-policy JSON file (`SitePolicy.save` / `load_site_policy`).
POLICY_FORMAT = "echo_jax.site_policy/1"
#: Forward sites per layer, in order: the attention output (g) and the MLP output (g).
SITES_PER_LAYER = 2
SITE_NAMES = ("attn", "mlp")
#: EchoConfig fields a policy file stores per config (the transport is the caller's choice).
POLICY_CONFIG_FIELDS = ("bits", "group_size", "policy", "rotation", "eta", "blend", "beta1",
                        "beta2", "min_bytes")


def _echo_fields() -> tuple:
    return tuple(f.name for f in dataclasses.fields(EchoConfig))


#: Wire bits per element of one site config (16 for exact); `echo_jax.calibration`.
config_wire_bits = site_wire_bits
#: The short name of a site config ("16", "4g128", "4g64-sym", "8g128-h", ...).
config_label = site_config_label


@dataclasses.dataclass(frozen=True)
class SitePolicy:
    """Per-(layer, site) all-reduce configs: a table of indices into a tuple of site configs.

    Args:
      configs: the distinct site configs, each an EchoConfig or None (the exact 16-bit psum).
      forward: one row per layer, (index of the attention-output site g, index of the MLP-output
        site g) into `configs`.
      backward: the same for the backward sites f (attention input, MLP input), or None: the
        backward sites of a layer use the forward row of that layer (the attention f site the
        attention g site's config, the MLP f the MLP g's). Only training runs backward sites.
      name: where the policy came from (a file name; used in messages and labels).

    Frozen and hashable (tuples only), so a CommConfig holding it stays a static jit argument.
    The compensator state has the same shape under every config, so configs with different bits,
    group sizes or rotations can follow each other along one pass (`echo_jax.tp`).
    """

    configs: tuple
    forward: tuple
    backward: Optional[tuple] = None
    name: str = ""

    def __post_init__(self):
        where = f"SitePolicy{' ' + repr(self.name) if self.name else ''}"
        if not isinstance(self.configs, tuple) or not self.configs:
            raise ValueError(f"{where}: configs must be a non-empty tuple of EchoConfig or None, "
                             f"got {self.configs!r}")
        for i, c in enumerate(self.configs):
            if c is not None and not isinstance(c, EchoConfig):
                raise ValueError(f"{where}: configs[{i}] must be an EchoConfig or None (exact), "
                                 f"got {c!r}")
        for i, c in enumerate(self.configs):
            if c in self.configs[:i]:
                raise ValueError(f"{where}: configs[{i}] repeats configs"
                                 f"[{self.configs.index(c)}] ({config_label(c)}); list each "
                                 "config once")
        for field in ("forward", "backward"):
            table = getattr(self, field)
            if table is None and field == "backward":
                continue
            table = _int_rows(table)  # numpy ints -> int (hashing and JSON stay plain)
            _check_table(table, len(self.configs), f"{where}: {field}")
            object.__setattr__(self, field, table)
        if self.backward is not None and len(self.backward) != len(self.forward):
            raise ValueError(f"{where}: backward has {len(self.backward)} rows, forward "
                             f"{len(self.forward)} (one per layer each)")
        if not isinstance(self.name, str):
            raise ValueError(f"{where}: name must be a str, got {self.name!r}")

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def uniform(cls, config: Optional[EchoConfig], n_layers: int, name: str = "") -> "SitePolicy":
        """Every site at `config`."""
        return cls((config,), ((0, 0),) * n_layers, None, name)

    @classmethod
    def early_8bit(cls, config: EchoConfig, n_layers: int) -> "SitePolicy":
        """The early-site policy of the Echo paper Sec. 7.2 (`CommConfig.early_8bit`): the
        first ceil(L / 2) layers at 8 bits, the rest at `config`."""
        configs = tp_ops.early_8bit_configs(config)
        half = (n_layers + 1) // 2          # tp.early_8bit_choice
        rows = tuple((0, 0) if layer < half else (1, 1) for layer in range(n_layers))
        return cls(configs, rows, None, f"early-8bit {config_label(config)}")

    @classmethod
    def from_choices(cls, options: Sequence[Optional[EchoConfig]], choice: Sequence[int],
                     name: str = "") -> "SitePolicy":
        """A policy from one option index per forward site (site order: layer 0 attention,
        layer 0 MLP, layer 1 attention, ...). Unused options are dropped."""
        choice = [int(c) for c in choice]
        if len(choice) % SITES_PER_LAYER:
            raise ValueError(f"from_choices: {len(choice)} site choices is not 2 per layer")
        used = sorted(set(choice))
        remap = {old: new for new, old in enumerate(used)}
        rows = tuple(tuple(remap[c] for c in choice[i:i + SITES_PER_LAYER])
                     for i in range(0, len(choice), SITES_PER_LAYER))
        return cls(tuple(options[i] for i in used), rows, None, name)

    # -- queries ---------------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return len(self.forward)

    def backward_rows(self) -> tuple:
        """The backward table (the forward one when `backward` is None)."""
        return self.forward if self.backward is None else self.backward

    def site_configs(self, backward: bool = False) -> tuple:
        """The config of every site in order (layer 0 attention, layer 0 MLP, layer 1 ...)."""
        rows = self.backward_rows() if backward else self.forward
        return tuple(self.configs[i] for row in rows for i in row)

    def wire_bits_per_element(self) -> float:
        """Mean nominal wire bits per element over the 2 L forward sites (every site of this
        model all-reduces a [B, T, D] message, so the mean over sites is the mean over bytes)."""
        bits = [config_wire_bits(c) for c in self.site_configs()]
        return sum(bits) / len(bits)

    def check_model(self, n_layers: int, model_name: str = "the model") -> None:
        """Raise a ValueError when the policy does not have one row per layer of the model."""
        if self.n_layers != n_layers:
            src = f"site policy {self.name!r}" if self.name else "the site policy"
            raise ValueError(f"{src} has {self.n_layers} layers (n_layers / forward rows) but "
                             f"{model_name} has {n_layers}")

    def tables(self):
        """(forward, backward) int32 numpy tables [L, 2]."""
        return (np.asarray(self.forward, np.int32).reshape(-1, SITES_PER_LAYER),
                np.asarray(self.backward_rows(), np.int32).reshape(-1, SITES_PER_LAYER))

    def label_counts(self) -> dict:
        """{config label: number of forward sites using it}, in order of first use."""
        counts = {}
        for c in self.site_configs():
            counts[config_label(c)] = counts.get(config_label(c), 0) + 1
        return counts

    def describe(self) -> str:
        """E.g. "policy.json: 4g128 x52, 8g128 x8; 4.50 bits"."""
        body = ", ".join(f"{k} x{v}" for k, v in self.label_counts().items())
        head = f"{Path(self.name).name}: " if self.name else ""
        return f"{head}{body}; {self.wire_bits_per_element():.3g} bits"

    def replace(self, **changes) -> "SitePolicy":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_configs(self, fn) -> "SitePolicy":
        """The same tables with every EchoConfig c replaced by fn(c) (None stays exact).
        Configs that become equal are merged."""
        new = [None if c is None else fn(c) for c in self.configs]
        uniq = []
        for c in new:
            if c not in uniq:
                uniq.append(c)
        remap = [uniq.index(c) for c in new]

        def table(rows):
            return None if rows is None else tuple(tuple(remap[i] for i in r) for r in rows)

        return SitePolicy(tuple(uniq), table(self.forward), table(self.backward), self.name)

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The JSON object of the policy (format `POLICY_FORMAT`), without model metadata."""
        return {"format": POLICY_FORMAT, "n_layers": self.n_layers,
                "configs": [config_to_dict(c) for c in self.configs],
                "config_labels": [config_label(c) for c in self.configs],
                "forward": [list(r) for r in self.forward],
                "backward": None if self.backward is None else [list(r) for r in self.backward],
                "wire_bits_per_element": self.wire_bits_per_element()}

    def save(self, path, *, model: Optional[str] = None, tp: Optional[int] = None,
             extra: Optional[dict] = None) -> dict:
        """Write the policy as JSON (plus `model`, `tp` and any `extra` keys, e.g. the
        calibration statistics); returns the record written."""
        record = self.to_dict()
        record = {"format": record.pop("format"), "model": model, "tp": tp, **record,
                  **(extra or {})}
        write_json(path, record)
        return record


def _int_rows(table):
    """Rows of numpy / Python integers as tuples of int; anything else is left to the check."""
    if not isinstance(table, (tuple, list)):
        return table
    out = []
    for row in table:
        if isinstance(row, (tuple, list)) or hasattr(row, "tolist"):
            row = tuple(int(i) if isinstance(i, numbers.Integral) and not isinstance(i, bool)
                        else i for i in (row.tolist() if hasattr(row, "tolist") else row))
        out.append(row)
    return tuple(out)


def _check_table(table, n_configs: int, where: str) -> None:
    if not isinstance(table, tuple) or not table:
        raise ValueError(f"{where} must be a non-empty tuple of per-layer rows, got {table!r}")
    for layer, row in enumerate(table):
        if not isinstance(row, tuple) or len(row) != SITES_PER_LAYER:
            raise ValueError(f"{where}[{layer}] = {row!r} must be a pair (attention site, "
                             "MLP site)")
        for s, i in enumerate(row):
            if not _is_int(i) or not 0 <= i < n_configs:
                raise ValueError(f"{where}[{layer}][{s}] = {i!r} is not an index into the "
                                 f"{n_configs} configs")


def config_to_dict(config: Optional[EchoConfig]) -> Optional[dict]:
    """The JSON object of one site config (None: exact). The transport is left out."""
    if config is None:
        return None
    names = _echo_fields()
    return {f: getattr(config, f) for f in POLICY_CONFIG_FIELDS if f in names}


def config_from_dict(entry, where: str, transport: str = "auto") -> Optional[EchoConfig]:
    """An EchoConfig from a JSON object (None / null: exact); errors name `where` and the field."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object of EchoConfig fields or null (exact 16-bit),"
                         f" got {entry!r}")
    names = _echo_fields()
    fields = {}
    for k, v in entry.items():
        if k == "transport":
            continue                    # the caller's choice (simulation: xla)
        if k not in names:
            if k == "rotation" and v == "none":
                continue                # written by an EchoConfig that knows rotations
            raise ValueError(f"{where}.{k} = {v!r}: not a field of EchoConfig "
                             f"(fields: {', '.join(names)})")
        fields[k] = v
    try:
        return EchoConfig(transport=transport, **fields)
    except ValueError as err:
        bad = next((k for k in fields if f"EchoConfig.{k} " in str(err)), None)
        at = f"{where}.{bad} = {fields[bad]!r}" if bad else where
        raise ValueError(f"{at}: {err}") from None


def site_policy_from_dict(record, name: str = "", transport: str = "auto") -> SitePolicy:
    """A SitePolicy from the JSON object of a policy file; errors name `name` and the field."""
    src = name or "site policy"
    if not isinstance(record, dict):
        raise ValueError(f"{src}: expected a JSON object, got {type(record).__name__}")
    fmt = record.get("format")
    if fmt != POLICY_FORMAT:
        raise ValueError(f"{src}: \"format\" = {fmt!r}, expected {POLICY_FORMAT!r}")
    configs = record.get("configs")
    if not isinstance(configs, list) or not configs:
        raise ValueError(f"{src}: \"configs\" = {configs!r} must be a non-empty list of "
                         "EchoConfig objects (null = exact 16-bit)")
    cfgs = tuple(config_from_dict(c, f"{src}: \"configs\"[{i}]", transport)
                 for i, c in enumerate(configs))

    def table(field, required):
        rows = record.get(field)
        if rows is None and not required:
            return None
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{src}: \"{field}\" = {rows!r} must be a list of [attention, MLP] "
                             "index pairs, one per layer")
        # JSON pairs become tuples; anything else stays as written, for the message.
        rows = tuple(tuple(r) if isinstance(r, list) and len(r) == SITES_PER_LAYER else r
                     for r in rows)
        _check_table(rows, len(cfgs), f"{src}: \"{field}\"")
        return rows

    fwd, bwd = table("forward", True), table("backward", False)
    n = record.get("n_layers", len(fwd))
    if n != len(fwd):
        raise ValueError(f"{src}: \"n_layers\" = {n!r} but \"forward\" has {len(fwd)} rows")
    if bwd is not None and len(bwd) != len(fwd):
        raise ValueError(f"{src}: \"backward\" has {len(bwd)} rows, \"forward\" {len(fwd)}")
    try:
        return SitePolicy(cfgs, fwd, bwd, name)
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from None


def load_site_policy(path, transport: str = "auto", *, return_record: bool = False):
    """Read a policy JSON file (`SitePolicy.save`); errors name the file, field and value.

    Args:
      path: the JSON file.
      transport: the Echo transport of every config (the file does not fix it).
      return_record: also return the whole JSON object (model, tp, calibration statistics).

    Returns:
      The SitePolicy (named after the file), or (policy, record).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"site policy file not found: {p}")
    try:
        record = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{p}: not valid JSON ({err})") from None
    policy = site_policy_from_dict(record, str(p), transport)
    return (policy, record) if return_record else policy


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
      site_policy: per-(layer, site) configs (`SitePolicy`, e.g. from `models.calibrate`)
        instead of one `echo` config everywhere; needs echo=None and early_8bit=False. The
        compensate flags apply to it as above (eta = 0 at the sites they switch off).
    """

    tp: int = 1
    axis_name: str = "tp"
    echo: Optional[EchoConfig] = None
    early_8bit: bool = False
    compensate_forward: bool = True
    compensate_backward: bool = True
    site_policy: Optional[SitePolicy] = None

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
        if self.site_policy is not None:
            if not isinstance(self.site_policy, SitePolicy):
                raise ValueError(f"CommConfig.site_policy must be a SitePolicy or None, "
                                 f"got {self.site_policy!r}")
            if self.echo is not None:
                raise ValueError("CommConfig.site_policy and CommConfig.echo are exclusive (the "
                                 "policy gives every site its config): set echo=None")
            if self.early_8bit:
                raise ValueError("CommConfig.site_policy and CommConfig.early_8bit=True are "
                                 "exclusive (SitePolicy.early_8bit expresses the early-site "
                                 "policy)")
        if self.early_8bit and self.echo is None:
            raise ValueError("CommConfig.early_8bit=True needs an Echo config "
                             "(CommConfig.echo is None: the exact baseline has no bits to choose)")
        dtypes = {c.state_dtype for c in self._echo_configs()}
        if len(dtypes) > 1:
            raise ValueError(f"CommConfig: the Echo configs disagree on state_dtype "
                             f"{sorted(dtypes)}; the compensator state flows from site to site, "
                             "so every site must store it in one dtype")

    def _echo_configs(self) -> tuple:
        if self.site_policy is not None:
            return tuple(c for c in self.site_policy.configs if c is not None)
        return () if self.echo is None else (self.echo,)

    @property
    def state_dtype(self) -> str:
        """The dtype of the compensator states ("float32" or "bfloat16"): the Echo configs'
        `state_dtype` (they agree), float32 for the exact baseline."""
        return next((c.state_dtype for c in self._echo_configs()), "float32")

    def replace(self, **changes) -> "CommConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def exact(self) -> bool:
        """Whether every site uses the exact `lax.psum` (no Echo, no site policy)."""
        return self.echo is None and self.site_policy is None

    def _site_configs(self, compensate: bool):
        if self.site_policy is not None:
            cfgs = self.site_policy.configs
            if not compensate:  # indices unchanged (duplicates are harmless in a switch)
                cfgs = tuple(None if c is None else c.replace(eta=0.0) for c in cfgs)
            return cfgs
        if self.echo is None:
            return None
        cfg = self.echo if compensate else self.echo.replace(eta=0.0)
        return tp_ops.early_8bit_configs(cfg) if self.early_8bit else cfg

    def forward_configs(self):
        """Site config(s) of the forward sites g: None, an EchoConfig, (8-bit, n-bit) with
        early_8bit, or the site policy's configs (indexed by `site_tables`)."""
        return self._site_configs(self.compensate_forward)

    def backward_configs(self):
        """Site config(s) of the backward sites f (see `forward_configs`)."""
        return self._site_configs(self.compensate_backward)

    def layer_choice(self, layer, n_layers: int):
        """Index into the site-config tuple for layer `layer` (traced ok) under early_8bit; None
        otherwise (a site policy's indices come from `site_tables`)."""
        if not self.early_8bit:
            return None
        return tp_ops.early_8bit_choice(layer, n_layers)

    def site_tables(self, n_layers: int):
        """(forward, backward) int32 numpy index tables [L, 2] of the site policy, or None.

        Row l holds the indices into `forward_configs()` (`backward_configs()`) of layer l's
        attention and MLP sites. A policy with another layer count raises a ValueError.
        """
        if self.site_policy is None:
            return None
        self.site_policy.check_model(n_layers)
        return self.site_policy.tables()

    def as_site_policy(self, n_layers: int) -> SitePolicy:
        """The configuration written as a SitePolicy (uniform, early 8-bit, or the policy)."""
        if self.site_policy is not None:
            self.site_policy.check_model(n_layers)
            return self.site_policy
        if self.early_8bit:
            return SitePolicy.early_8bit(self.echo, n_layers)
        return SitePolicy.uniform(self.echo, n_layers)

    def site_configs(self, n_layers: int, backward: bool = False) -> tuple:
        """The (uncompensated-flag-free) config of each of the 2 L forward (or backward) sites,
        in order: layer 0 attention, layer 0 MLP, layer 1 attention, ..."""
        return self.as_site_policy(n_layers).site_configs(backward)

    def wire_bits_per_element(self, n_layers: int) -> float:
        """Average nominal wire bits per element over the 2 L forward sites of one pass: 16 for
        exact sites, `EchoConfig.wire_bits_per_element` for Echo ones (every site reduces an
        equally sized [B, T, D] message, so this is the mean over sites). Padding of the last
        groups is not counted (`models.eval.wire_bits_per_element` counts it)."""
        return self.as_site_policy(n_layers).wire_bits_per_element()

    def describe(self) -> str:
        """A short label, e.g. "P=4 echo 4-bit comp", "P=4 exact" or
        "P=3 echo site policy (policy.json: 4g128 x56, 8g128 x4; 4.52 bits) comp"."""
        if self.site_policy is not None:
            comp = "comp" if any(c is not None and c.compensated for c in
                                 self.site_policy.configs) and (
                self.compensate_forward or self.compensate_backward) else "nocomp"
            return f"P={self.tp} echo site policy ({self.site_policy.describe()}) {comp}"
        if self.echo is None:
            return f"P={self.tp} exact"
        e = self.echo
        comp = "comp" if e.compensated and (self.compensate_forward or
                                            self.compensate_backward) else "nocomp"
        bits = f"8/{e.bits}-bit" if self.early_8bit else f"{e.bits}-bit"
        return f"P={self.tp} echo {bits} {comp}"


def check_comm(model: "ModelConfig", comm: CommConfig) -> None:
    """`check_tp` plus: a site policy must have one row per layer of `model`."""
    check_tp(model, comm.tp)
    if comm.site_policy is not None:
        comm.site_policy.check_model(model.n_layers, f"model {model.name!r}")


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


__all__ = ["ModelConfig", "CommConfig", "SitePolicy", "check_tp", "check_comm", "supported_tp",
           "PRESETS", "get_config", "COMPUTE_DTYPES", "PARAM_DTYPES", "POLICY_FORMAT",
           "SITE_NAMES", "config_wire_bits", "config_label", "config_to_dict",
           "config_from_dict", "site_policy_from_dict", "load_site_policy"]
