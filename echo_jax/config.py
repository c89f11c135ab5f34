"""Configuration of the Echo all-reduce.

`EchoConfig` is a frozen, hashable dataclass, so it can be a static argument of `jax.jit` and a
field of a Flax module. Every bad value raises `ValueError` naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from echo_jax import policies as _policies

POLICIES = _policies.NAMES
TRANSPORTS = ("auto", "p2p", "xla")
BITS = (4, 8)
ROTATIONS = ("none", "hadamard")
STATE_DTYPES = ("float32", "bfloat16", "int8", "int4")
#: The state dtypes stored as integer codes with one power-of-two scale per 128 values.
QUANTIZED_STATE_DTYPES = ("int8", "int4")
STATE_UPDATES = ("in_call", "separate")
RESIDUALS = ("output", "local")
#: The smallest nonzero compensator coefficient (eta * blend, eta * (1 - blend), beta1, beta2 in
#: fp32) the int8 and int4 states take: their kernels fold the coefficients into the scales.
INT8_STATE_MIN_COEFFICIENT = 2.0 ** -20


@dataclasses.dataclass(frozen=True)
class EchoConfig:
    """Settings of one Echo all-reduce site.

    Args:
      bits: bits per value on the wire, 4 or 8.
      group_size: values per quantization group g (one bf16 scale, plus an fp16 zero-point for the
        asymmetric policies). Must be even at 4 bits, since two codes share a byte.
      policy: "asym" (zero-aware asymmetric, the Echo paper Sec. 4.3), "sym" (Eq. 8) or
        "asym_naive" (Eq. 9 with the zero-point left where the group minimum puts it; ablation).
      eta: gain of the compensator (Eq. 10); 0 disables compensation.
      blend: weight a of the slow average m1 in the correction c = eta (a m1 + (1 - a) m2).
      beta1: decay of the slow average m1 (Eq. 11).
      beta2: decay of the fast average m2 (Eq. 11).
      transport: "xla" (quantized all-to-all + all-gather in pure JAX), "p2p" (the Echo custom
        call) or "auto" (p2p where it can run, else xla).
      min_bytes: size gate. A contribution (each array of a pytree on its own) of fewer than
        `min_bytes` bytes per rank, counted in its own dtype, is summed by `lax.psum` instead
        (exact, no compensation; a compensator state passes through unchanged). Small messages
        are latency-bound, so the quantize and the extra round of the Echo protocol can make
        them slower than psum. Default 0 (the gate is off): the crossover depends on the
        machine, so measure it there with `python -m echo_jax_tools.bench gate`.
      rotation: "none", or "hadamard": a randomized block Hadamard rotation (`echo_jax.rotation`)
        of each group of g values before quantizing, undone after the sum. It spreads an
        outlier channel over its whole group, so the group's scale no longer follows the
        outlier. The wire format and cost are unchanged; needs a power-of-two group_size.
        The custom calls rotate inside the call (CPU: every power-of-two g; CUDA: g <= 1024),
        rescaled or not, and a compensated call stays fused; elsewhere (the "xla" transport, a
        custom call that does not rotate) the rotation is plain JAX around the transport and the
        compensator's steps run in JAX around it. Same bits either way; the compensator state
        stays in the original basis.
      state_dtype: storage dtype of the compensator state (m1, m2): "float32" (default) or
        "bfloat16" (a NumPy / JAX dtype or its name is accepted and stored as the name). The
        apply and update steps compute in fp32 either way; a bfloat16 state is widened exactly
        and the new averages are rounded to nearest even when stored (`echo_jax.compensator`).
        The fused custom calls (CPU and CUDA) take either dtype, with the same bits as the
        xla transport's apply and update steps in JAX. "int8": m1, m2 as 8-bit codes with one
        fp32 scale per 128 values (`echo_jax.compensator.STATE_GROUP`; a quarter of the fp32
        state's bytes): fused into the custom calls (CPU and CUDA) with group_size=128, else
        run in JAX around the uncompensated call (the call plan says why). Its coefficients
        (eta * blend, eta * (1 - blend), beta1, beta2, each in fp32) must each be 0 or at least
        2^-20 (INT8_STATE_MIN_COEFFICIENT): the CUDA stages multiply them into the state's
        power-of-two scales, exactly in that range. "int4": the same with 4-bit codes in
        [-7, 7] (two a byte; an eighth of the fp32 state's bytes, half the int8 state's), meant
        for residual="local", where each rank's residual is error-scale: fused into the custom
        calls with residual="local" (CUDA) or either residual (CPU), with the same rules.
      state_update: where a compensated call's update step (Eq. 4 and 11) runs. "in_call"
        (default): inside the all-reduce, where y is produced (the fused custom calls' exit
        pass: the fewest bytes, but on the critical path). "separate": the call runs the apply
        step in its entry pass and returns y; the update is its own op after it (reading x, y,
        m1, m2 and writing m1, m2, the Echo paper Sec. 5.3 and Appendix C), which on GPUs is
        put on a second stream (`compensator.update_beside`) so that it can run beside the next
        matrix multiplication. The residual is then u = x' - y / P with y as returned, in x's
        dtype: the same bits as "in_call" for float32 x; for a 16-bit x the output's rounding is
        fed back too.
      residual: which residual feeds the averages (Eq. 11). "output" (default): the Echo paper's
        u = x' - y / P (Eq. 4), formed from the call's output; each rank's u is data-scale, and
        only their sum over the ranks is the injected error. "local": each rank's own rounding
        errors, taken where they are made: x' - Q(x') for the segments it sends, and on the
        segment it owns the sum's error s - Q(s). They sum over the ranks to the same error as
        the "output" residuals (exactly, up to the fp32 rounding of the sum; the correction is
        linear in the state, so the aggregate correction C of Eq. 5 is the same), but each is
        error-scale, and the call needs no pass over x, m1, m2 after the sum: the fused calls
        update the state where they quantize (`echo_jax.compensator`). Needs rotation="none"
        and state_update="in_call".

    Properties:
      wire_bits_per_element: bits sent per value by one quantized copy, codes plus the 16-bit
        parameters of its group spread over the group (4.25 at 4 bits, g = 128, asym).
    """

    bits: int = 4
    group_size: int = 128
    policy: str = "asym"
    eta: float = 0.75
    blend: float = 0.35
    beta1: float = 0.7
    beta2: float = 0.3
    transport: str = "auto"
    min_bytes: int = 0
    rotation: str = "none"
    state_dtype: str = "float32"
    state_update: str = "in_call"
    residual: str = "output"

    def __post_init__(self):
        # Numbers arrive as Python or NumPy scalars (np.int64(64), np.float32(0.5), 128.0):
        # accept exactly what int() / float() represent without loss, store the Python value,
        # and reject the rest (bool, strings, 128.5) with a message naming the field.
        for name in ("bits", "group_size", "min_bytes"):
            object.__setattr__(self, name, _as_int(name, getattr(self, name)))
        for name in ("eta", "blend", "beta1", "beta2"):
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        if self.bits not in BITS:
            raise ValueError(f"EchoConfig.bits must be 4 or 8, got {self.bits!r}")
        g = self.group_size
        if g <= 0:
            raise ValueError(f"EchoConfig.group_size must be a positive int, got {g!r}")
        if self.bits == 4 and g % 2:
            raise ValueError(
                f"EchoConfig.group_size must be even at 4 bits (two codes per byte), got {g}")
        if self.policy not in POLICIES:
            raise ValueError(f"EchoConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("eta", "blend"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"EchoConfig.{name} must be in [0, 1], got {v!r}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"EchoConfig.{name} must be in [0, 1), got {v!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"EchoConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        m = self.min_bytes
        if m < 0:
            raise ValueError(f"EchoConfig.min_bytes must be an int >= 0, got {m!r}")
        if not isinstance(self.rotation, str) or self.rotation not in ROTATIONS:
            raise ValueError(
                f"EchoConfig.rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.rotation == "hadamard" and g & (g - 1):
            raise ValueError(
                f"EchoConfig.group_size must be a power of two with rotation='hadamard' (one "
                f"Hadamard block per group), got {g}")
        object.__setattr__(self, "state_dtype", _as_state_dtype(self.state_dtype))
        if not isinstance(self.state_update, str) or self.state_update not in STATE_UPDATES:
            raise ValueError(f"EchoConfig.state_update must be one of {STATE_UPDATES}, got "
                             f"{self.state_update!r}")
        if not isinstance(self.residual, str) or self.residual not in RESIDUALS:
            raise ValueError(f"EchoConfig.residual must be one of {RESIDUALS}, got "
                             f"{self.residual!r}")
        if self.state_dtype in QUANTIZED_STATE_DTYPES:
            # The quantized states' CUDA stages multiply each coefficient into a group's scale (a
            # power of two >= 2^-106): exact, and so the same bits, for 0 and [2^-20, 1].
            # The fp32 values of compensator.Coefficients.from_config, computed the same way
            # here: this module may not import that one (it imports this one).
            e, a = self.eta, self.blend
            coeffs = {"eta * blend": e * a, "eta * (1 - blend)": e * (1.0 - a),
                      "beta1": self.beta1, "beta2": self.beta2}
            for name, c in coeffs.items():
                c = float(np.float32(c))
                if 0.0 < c < INT8_STATE_MIN_COEFFICIENT:
                    raise ValueError(
                        f"EchoConfig(state_dtype={self.state_dtype!r}) needs {name} to be 0 or "
                        f"at least 2^-20, got {c!r}: the {self.state_dtype} state's kernels "
                        "multiply it into the state's "
                        "scales, which is exact from 2^-20 on; use 0, a larger value or "
                        "state_dtype='bfloat16'")
        if self.residual == "local" and self.rotation != "none":
            raise ValueError("EchoConfig.residual='local' takes the rounding errors where the "
                             f"call quantizes, which needs rotation='none' (got rotation="
                             f"{self.rotation!r}); use residual='output' with a rotation")
        if self.residual == "local" and self.state_update != "in_call":
            raise ValueError("EchoConfig.residual='local' updates the state inside the call, "
                             f"which needs state_update='in_call' (got state_update="
                             f"{self.state_update!r}); use residual='output' with a separate "
                             "update")

    @property
    def wire_bits_per_element(self) -> float:
        """Wire bits per value: bits + 16 * (16-bit parameters per group) / group_size.

        One bf16 scale per group for "sym", a bf16 scale and an fp16 zero-point for "asym" and
        "asym_naive" (`echo_jax.policies`); the rotation adds nothing to the wire.
        """
        return _policies.wire_bits_per_element(self.bits, self.group_size, self.policy)

    @property
    def compensated(self) -> bool:
        """Whether a compensator state changes the result (eta > 0)."""
        return self.eta > 0.0

    def gated(self, nbytes: int) -> bool:
        """Whether the size gate sends a contribution to `lax.psum`.

        Args:
          nbytes: bytes of one rank's contribution (one array), in its own dtype.

        Returns:
          True when nbytes < min_bytes.
        """
        return nbytes < self.min_bytes

    def replace(self, **changes) -> "EchoConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _as_state_dtype(v) -> str:
    """A state dtype (a name, a NumPy / JAX dtype or scalar type) as its canonical name."""
    bad = ValueError(f"EchoConfig.state_dtype must be one of {STATE_DTYPES}, got {v!r}")
    if isinstance(v, (bool, np.bool_, numbers.Number)) or v is None:
        raise bad
    try:
        import ml_dtypes  # shipped with JAX; names numpy's extension dtype "bfloat16"

        named = {"bfloat16": ml_dtypes.bfloat16, "int4": ml_dtypes.int4}
        name = np.dtype(named.get(v, v) if isinstance(v, str) else v).name
    except (TypeError, ValueError, AttributeError):
        raise bad from None
    if name not in STATE_DTYPES:
        raise bad
    return name


def _as_int(name: str, v) -> int:
    """An integral number (int, NumPy integer, or a float with an integer value) as an int."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, numbers.Real)):
        raise ValueError(f"EchoConfig.{name} must be an int, got {v!r}")
    if isinstance(v, numbers.Integral):
        return int(v)
    f = float(v)
    if not math.isfinite(f) or f != int(f):
        raise ValueError(f"EchoConfig.{name} must be an int, got {v!r}")
    return int(f)


def _as_float(name: str, v) -> float:
    """A real number (int, float or NumPy scalar, not bool, not NaN) as a Python float."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise ValueError(f"EchoConfig.{name} must be a real number, got {v!r}")
    f = float(v)
    if f != f:
        raise ValueError(f"EchoConfig.{name} must be a real number, got {v!r}")
    return f
