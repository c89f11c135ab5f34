"""EchoConfig validation: every bad value raises ValueError naming the field and the value."""

import pytest

from echo_jax import EchoConfig


def test_defaults_match_the_paper():
    c = EchoConfig()
    assert (c.bits, c.group_size, c.policy) == (4, 128, "asym")
    assert (c.eta, c.blend, c.beta1, c.beta2) == (0.75, 0.35, 0.7, 0.3)
    assert c.transport == "auto"
    assert c.min_bytes == 0  # the size gate is off unless measured for the machine
    assert c.rotation == "none"
    assert hash(c) == hash(EchoConfig())  # usable as a static jit argument


@pytest.mark.parametrize("field,value", [
    ("bits", 3), ("bits", 16), ("bits", True), ("group_size", 0), ("group_size", -4),
    ("group_size", 127), ("group_size", 12.5), ("policy", "fp8"), ("eta", 1.5), ("eta", -0.1),
    ("blend", 2.0), ("beta1", 1.0), ("beta2", -0.5), ("eta", float("nan")),
    ("transport", "nccl"), ("min_bytes", -1), ("min_bytes", 1.5), ("min_bytes", True),
    ("rotation", "walsh"), ("rotation", None), ("rotation", "Hadamard"),
])
def test_bad_values_name_field_and_value(field, value):
    with pytest.raises(ValueError) as info:
        EchoConfig(**{field: value})
    assert field in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_odd_group_allowed_at_8_bits():
    assert EchoConfig(bits=8, group_size=127).group_size == 127


def test_frozen_and_replace():
    c = EchoConfig()
    with pytest.raises(Exception):
        c.bits = 8
    assert c.replace(bits=8).bits == 8
    with pytest.raises(ValueError, match="bits"):
        c.replace(bits=5)


def test_size_gate_threshold():
    c = EchoConfig(min_bytes=1 << 20)
    assert c.gated((1 << 20) - 1) and not c.gated(1 << 20)
    assert not EchoConfig().gated(0)
    assert hash(c) != hash(EchoConfig())


@pytest.mark.parametrize("g", [96, 100, 6])
def test_hadamard_needs_a_power_of_two_group(g):
    with pytest.raises(ValueError) as info:
        EchoConfig(group_size=g, rotation="hadamard")
    assert "group_size" in str(info.value) and str(g) in str(info.value)
    assert "power of two" in str(info.value)
    assert EchoConfig(group_size=g).rotation == "none"  # fine without the rotation
    with pytest.raises(ValueError, match="power of two"):
        EchoConfig(group_size=64, rotation="hadamard").replace(group_size=g)


@pytest.mark.parametrize("g", [2, 32, 64, 128, 256])
def test_hadamard_accepts_power_of_two_groups(g):
    c = EchoConfig(group_size=g, rotation="hadamard", bits=8)
    assert c.rotation == "hadamard" and hash(c) != hash(c.replace(rotation="none"))


@pytest.mark.parametrize("bits,policy,g,want", [
    (4, "asym", 128, 4.25), (4, "asym_naive", 128, 4.25), (4, "sym", 128, 4.125),
    (4, "asym", 64, 4.5), (4, "sym", 64, 4.25), (4, "asym", 32, 5.0), (4, "sym", 32, 4.5),
    (8, "asym", 128, 8.25), (8, "sym", 128, 8.125), (8, "asym", 64, 8.5), (8, "sym", 32, 8.5),
])
def test_wire_bits_per_element(bits, policy, g, want):
    from echo_jax import quant
    for rotation in ("none", "hadamard"):  # the rotation adds nothing to the wire
        c = EchoConfig(bits=bits, policy=policy, group_size=g, rotation=rotation)
        assert c.wire_bits_per_element == want
        assert c.wire_bits_per_element == 8 * quant.wire_bytes_per_group(g, bits, policy) / g
