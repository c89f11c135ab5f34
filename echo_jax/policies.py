"""The one table of quantizer policies and the wire cost they imply (no JAX import).

Every module that names a policy reads it here: `EchoConfig.policy` is checked against `NAMES`,
the quantizer (`echo_jax.quant`) takes its parameter count from `num_params`, the custom calls
take the integer `code` (the order of this table; ffi/echo_common.h has the same enum and
`kNumPolicies`), and the site-config names of `echo_jax.calibration` use `label`.

=============  ====  ======  =====  ==========================================================
name           code  params  label  meaning
=============  ====  ======  =====  ==========================================================
"asym"         0     2       asym   zero-aware asymmetric (the Echo paper Sec. 4.3): scale and
                                    zero-point, the zero-point rounded to an integer in a group
                                    that straddles zero
"sym"          1     1       sym    symmetric (Eq. 8): scale only
"asym_naive"   2     2       naive  asymmetric (Eq. 9) with the zero-point where the group
                                    minimum puts it (ablation)
=============  ====  ======  =====  ==========================================================

Wire cost (`wire_bits_per_element`, the Echo paper Sec. 4): one quantized copy of a value
costs its b-bit code plus the 16-bit parameters of its group (a bf16 scale, and for asym an
fp16 zero-point) spread over the group's g values, b + 16 * params / g bits (4.25 at 4 bits,
g = 128, asym). Padding to whole groups is not counted. `EchoConfig.wire_bits_per_element` and
`calibration.site_wire_bits` call it.
"""

from __future__ import annotations

from typing import NamedTuple


class Policy(NamedTuple):
    """One row of the policy table.

    Attributes:
      name: the value of `EchoConfig.policy`.
      code: the integer attribute "policy" of the custom calls (C++ enum `echo::Policy`).
      num_params: 16-bit parameters per group (the bf16 scale; plus the fp16 zero-point for
        asym policies).
      label: the suffix of a site-config name (`calibration.site_config_label`, "-sym").
    """

    name: str
    code: int
    num_params: int
    label: str


#: The table, in code order.
TABLE = (
    Policy("asym", 0, 2, "asym"),
    Policy("sym", 1, 1, "sym"),
    Policy("asym_naive", 2, 2, "naive"),
)

#: Policy names in code order (`EchoConfig.policy` takes one of these).
NAMES = tuple(p.name for p in TABLE)
#: name -> integer code of the custom calls: asym 0, sym 1, asym_naive 2.
CODES = {p.name: p.code for p in TABLE}
#: site-config label -> name ("naive" -> "asym_naive").
BY_LABEL = {p.label: p.name for p in TABLE}
#: name -> site-config label.
LABELS = {p.name: p.label for p in TABLE}

_BY_NAME = {p.name: p for p in TABLE}


def get(policy: str) -> Policy:
    """The table row of a policy name.

    Args:
      policy: a policy name.

    Returns:
      Its `Policy` row.

    Raises:
      ValueError: the name is not in the table (the message lists the names).
    """
    try:
        return _BY_NAME[policy]
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {NAMES}, got {policy!r}") from None


def num_params(policy: str) -> int:
    """16-bit parameters per group: 1 for sym (bf16 scale), 2 for asym (bf16 scale, fp16
    zero-point)."""
    return get(policy).num_params


def code(policy: str) -> int:
    """The integer code of the custom calls' "policy" attribute."""
    return get(policy).code


def wire_bits_per_element(bits: int, group_size: int, policy: str) -> float:
    """Bits on the wire per value of one quantized copy: bits + 16 * params / group_size.

    Args:
      bits: code bits b (4 or 8).
      group_size: values per group g.
      policy: a policy name (its 16-bit parameter count).

    Returns:
      The cost in bits per element, padding not counted (4.25 at 4 bits, g = 128, asym).
    """
    return bits + 16 * num_params(policy) / group_size


def wire_bytes_per_group(group_size: int, bits: int, policy: str) -> int:
    """Bytes on the wire per group: g * b / 8 of codes plus 2 per 16-bit parameter.

    Args:
      group_size: values per group g.
      bits: code bits b.
      policy: a policy name.

    Returns:
      68 for g = 128, 4-bit asym.
    """
    return group_size * bits // 8 + 2 * num_params(policy)


__all__ = ["Policy", "TABLE", "NAMES", "CODES", "BY_LABEL", "LABELS", "get", "num_params", "code",
           "wire_bits_per_element", "wire_bytes_per_group"]
