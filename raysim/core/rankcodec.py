"""Bit-packing of rankings and rank positions: ceil(log2 n) bits per entry.

A ranking of a layer with n edges is a permutation of 0..n-1, so every entry fits in
`bits_for(n) = ceil(log2 n)` bits; FRL sends rankings down and positions up in this form
(Mozaffari et al. 2023, Section 4). Entry e occupies global bits [e*b, (e+1)*b), least
significant bit first, and bit p lives in byte p // 8 at bit p % 8 (little-endian bit order).
Packing works on chunks of a fixed number of entries (a multiple of 8, so every chunk ends on a
byte boundary) to keep the temporary bit matrix small for multi-million-edge layers.
"""

from __future__ import annotations

import numpy as np

# Entries per chunk; a multiple of 8 so each chunk's bits fill whole bytes.
CHUNK_ENTRIES = 1 << 16


def bits_for(n: int) -> int:
    """Bits per entry for values in [0, n): ceil(log2 n), 0 when n <= 1."""
    return 0 if n <= 1 else int(n - 1).bit_length()


def packed_nbytes(n: int, count: int | None = None) -> int:
    """Bytes of `count` packed entries (default n: a whole permutation): ceil(count*b / 8)."""
    count = n if count is None else count
    return -(-count * bits_for(n) // 8)


def pack(values: np.ndarray, n: int) -> np.ndarray:
    """Pack integers in [0, n) into a uint8 array of `packed_nbytes(n, len(values))` bytes."""
    values = np.asarray(values).reshape(-1)
    bits = bits_for(n)
    if len(values) and (values.min() < 0 or values.max() >= n):
        raise ValueError(f"values must lie in [0, {n}), got [{values.min()}, {values.max()}]")
    if bits == 0 or not len(values):
        return np.zeros(0, dtype=np.uint8)
    chunks = []
    for start in range(0, len(values), CHUNK_ENTRIES):
        # Each value's 8 little-endian bytes -> its bits, LSB first; keep the low `bits`.
        chunk = values[start : start + CHUNK_ENTRIES].astype("<u8").view(np.uint8)
        bit_matrix = np.unpackbits(chunk.reshape(-1, 8), axis=1, bitorder="little")
        chunks.append(np.packbits(bit_matrix[:, :bits].reshape(-1), bitorder="little"))
    return np.concatenate(chunks)


def unpack(packed: np.ndarray, n: int, count: int) -> np.ndarray:
    """Inverse of `pack`: `count` int64 values in [0, 2**bits_for(n))."""
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    bits = bits_for(n)
    expected = packed_nbytes(n, count)
    if len(packed) != expected:
        raise ValueError(
            f"packed array has {len(packed)} bytes; {count} entries of {bits} bits need {expected}"
        )
    if bits == 0:
        return np.zeros(count, dtype=np.int64)
    chunk_bytes = CHUNK_ENTRIES * bits // 8
    out = np.empty(count, dtype=np.int64)
    for chunk_index, start in enumerate(range(0, count, CHUNK_ENTRIES)):
        entries = min(CHUNK_ENTRIES, count - start)
        raw = packed[chunk_index * chunk_bytes : chunk_index * chunk_bytes + chunk_bytes]
        bit_matrix = np.zeros((entries, 64), dtype=np.uint8)
        bit_matrix[:, :bits] = np.unpackbits(raw, count=entries * bits, bitorder="little").reshape(
            entries, bits
        )
        # Bits back into 8 little-endian bytes per value, read as one uint64 each.
        as_bytes = np.packbits(bit_matrix, axis=1, bitorder="little")
        out[start : start + entries] = as_bytes.view("<u8").reshape(-1)
    return out
