r"""Randomized block Hadamard rotation of the all-reduce input (`EchoConfig.rotation="hadamard"`).

A flat fp32 vector whose length is a multiple of g is cut into blocks of g values, the same blocks
as the quantization groups of the wire layout. Each block is rotated by the orthogonal matrix

    R = H_g / sqrt(g) . diag(s)          (forward)        R^-1 = R^T = diag(s) . H_g / sqrt(g)

where H_g is the Sylvester Hadamard matrix (symmetric, entries +-1, H_g H_g = g I) and s a fixed
+-1 sign vector of length g. A channel with a massive outlier then no longer sets its group's
scale alone: its energy is spread evenly over the g rotated values, so the other g - 1 values of
the group keep a useful share of the 2^b codes. The rotation is linear and orthogonal and the sum
commutes with it, so the all-reduce of the rotated contributions, rotated back, is the sum again
(up to the quantization error, which the rotation only moves between coordinates).

Determinism. Every rank and every transport must apply the same R and get the same bits:

* The signs come from a fixed integer hash (splitmix64) of (seed, index), evaluated with numpy at
  trace time and baked into the program as a constant. It does not depend on a random-number API
  whose stream could change between library versions or hosts.
* H_g is applied as a fast Walsh-Hadamard transform: log2(g) butterfly stages (a + b, a - b) on
  reshaped arrays, not as a [g, g] matmul. Each output is then a fixed tree of IEEE fp32 additions
  and subtractions that XLA cannot reorder, whereas a dot's accumulation order belongs to the
  backend's GEMM and may change with the shape (for example under vmap) or the backend. It is
  also O(g log g) per block instead of O(g^2).
* The sign multiply (by +-1) is exact. The 1/sqrt(g) factor, rounded once from float64 to fp32, is
  one rounded product per value, materialised behind an optimization barrier so that no backend
  fuses it into a following addition (see `echo_jax.quant._no_fma`).

The butterfly sums and the 1/sqrt(g) product round in fp32, so `hadamard_unrotate(
hadamard_rotate(x))` equals x up to a few fp32 ulps of the block's magnitude, not bit for bit.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from echo_jax.quant import _no_fma

#: Seed of the sign vector. Changing it changes every rotated all-reduce's bits.
SIGN_SEED = 0x4563686F  # "Echo"

_M64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 arrays (wrapping arithmetic, exact on every host)."""
    z = (z + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_M64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _check_group_size(group_size) -> int:
    g = group_size
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0 or g & (g - 1):
        raise ValueError(f"Hadamard rotation: group_size must be a power of two, got {g!r}")
    return int(g)


@functools.lru_cache(maxsize=None)
def _signs(g: int) -> np.ndarray:
    idx = np.arange(g, dtype=np.uint64) + (np.uint64(SIGN_SEED) << np.uint64(32))
    with np.errstate(over="ignore"):
        bit = _splitmix64(idx) >> np.uint64(63)
    s = np.where(bit == 1, np.float32(-1), np.float32(1)).astype(np.float32)
    s.setflags(write=False)
    return s


def hadamard_signs(group_size: int) -> np.ndarray:
    """The fixed +-1 sign vector s of the rotation (the same on every rank, host and call).

    Args:
      group_size: block length g, a power of two.

    Returns:
      A read-only float32 numpy array of g values, each +1 or -1.
    """
    return _signs(_check_group_size(group_size))


def _fwht(x, g: int):
    """Unnormalized Walsh-Hadamard transform (Sylvester order) of every row of x: [nb, g]."""
    nb = x.shape[0]
    h = 1
    while h < g:
        # Pair element i with element i + h inside every block of 2h: (a, b) -> (a + b, a - b).
        y = x.reshape(nb, g // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = jnp.stack([a + b, a - b], axis=2).reshape(nb, g)
        h *= 2
    return x


def _blocks(x, group_size, where):
    g = _check_group_size(group_size)
    shape, dtype = jnp.shape(x), jnp.result_type(x)
    if len(shape) != 1 or dtype != jnp.float32:
        raise ValueError(f"{where}: expects a flat float32 array, got {dtype}{list(shape)}")
    if shape[0] % g:
        raise ValueError(f"{where}: length {shape[0]} is not a multiple of group_size {g}; pad "
                         "with zeros to whole blocks first")
    return g, jnp.reshape(x, (shape[0] // g, g))


def hadamard_rotate(x_flat32, group_size: int):
    """Forward rotation y = H_g / sqrt(g) . diag(s) x of every block of g values.

    Args:
      x_flat32: float32 [n] with n a multiple of group_size.
      group_size: block length g, a power of two (the quantization group size).

    Returns:
      float32 [n], the rotated blocks in place of the original ones (same Euclidean norm).
    """
    g, x = _blocks(x_flat32, group_size, "hadamard_rotate")
    if x.shape[0] == 0:
        return jnp.reshape(x, (-1,))
    y = _fwht(x * _signs(g), g)                       # sign flips are exact
    y = _no_fma(y * np.float32(1.0 / np.sqrt(g)))     # one rounding, never fused into an add
    return y.reshape(-1)


def hadamard_unrotate(y_flat32, group_size: int):
    """Inverse rotation x = diag(s) . H_g^T / sqrt(g) y of every block (H_g is symmetric).

    Args:
      y_flat32: float32 [n] with n a multiple of group_size, e.g. from `hadamard_rotate`.
      group_size: block length g, a power of two (as in the forward rotation).

    Returns:
      float32 [n] in the original basis.
    """
    g, y = _blocks(y_flat32, group_size, "hadamard_unrotate")
    if y.shape[0] == 0:
        return jnp.reshape(y, (-1,))
    sc = _signs(g) * np.float32(1.0 / np.sqrt(g))     # +-f32(1/sqrt(g)), exact
    x = _no_fma(_fwht(y, g) * sc)
    return x.reshape(-1)


__all__ = ["hadamard_rotate", "hadamard_unrotate", "hadamard_signs", "SIGN_SEED"]
