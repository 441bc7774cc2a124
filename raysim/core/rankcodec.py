"""Bit-packing of rankings and rank positions: ceil(log2 n) bits per entry.

A ranking of a layer with n edges is a permutation of 0..n-1, so every entry fits in
`bits_for(n) = ceil(log2 n)` bits; FRL sends rankings down and positions up in this form
(Mozaffari et al. 2023, Section 4). Entry e occupies global bits [e*b, (e+1)*b), least
significant bit first, and bit p lives in byte p // 8 at bit p % 8 (little-endian bit order).
Packing works on chunks of a fixed number of entries (a multiple of 64, so every chunk ends on a
64-bit word boundary) to keep the temporaries small for multi-million-edge layers. Within a
chunk, every 64 consecutive entries fill exactly `bits` little-endian uint64 words, and entry i
of such a group always lands at the same word and shift (`_group_plan`); so a chunk is packed or
unpacked with ~2 * 64 whole-column shifts and ORs instead of a matrix of single bits (~3x
faster on a 262,144-edge layer; the same bytes). Those ~130 numpy calls cost ~0.13 ms whatever
the size, so arrays of up to SMALL_ENTRIES entries go through the matrix of single bits
instead (numpy's packbits / unpackbits, a few calls: 2,048 entries 38 us against 128 us to
pack; the crossover is near 8,192): FRL's small layers, a thousand clients a round.

`pack_rows` / `unpack_rows` do the same for several clients' positions at once, the rows of one
2-D array (a batched chunk's: raysim.core.wire_chunk): row i packs to exactly `pack(row i)`'s
bytes, all rows as one bit stream through the word-wise path, so a thousand clients' small
layers cost one pass instead of a few numpy calls a client.
"""

from __future__ import annotations

import numpy as np

# Entries per chunk; a multiple of 64 so each chunk's bits fill whole 64-bit words.
CHUNK_ENTRIES = 1 << 16  # 512 KiB temporaries: larger ones cost page faults each call
# Up to this many entries, a matrix of single bits (fewer numpy calls; see the docstring).
SMALL_ENTRIES = 4096


def bits_for(n: int) -> int:
    """Bits per entry for values in [0, n): ceil(log2 n), 0 when n <= 1."""
    return 0 if n <= 1 else int(n - 1).bit_length()


def packed_nbytes(n: int, count: int | None = None) -> int:
    """Bytes of `count` packed entries (default n: a whole permutation): ceil(count*b / 8)."""
    count = n if count is None else count
    return -(-count * bits_for(n) // 8)


def _group_plan(bits: int) -> list[tuple[int, int, bool]]:
    """Per entry i of a group of 64: (its word, its shift in that word, whether its high bits
    spill into the next word). A group of 64 entries is exactly `bits` words."""
    return [((i * bits) // 64, (i * bits) % 64, (i * bits) % 64 + bits > 64) for i in range(64)]


def _transposed(matrix: np.ndarray) -> np.ndarray:
    """`matrix.T` as a new contiguous array, copied in blocks of rows: one whole-matrix
    transpose of a (4096, 64) array strides by 512 bytes, a power of two that maps its reads
    to a few cache sets (~10x slower than these blocks)."""
    rows = matrix.shape[0]
    out = np.empty(matrix.shape[::-1], dtype=matrix.dtype)
    for start in range(0, rows, 256):
        out[:, start : start + 256] = matrix[start : start + 256].T
    return out


def pack(values: np.ndarray, n: int) -> np.ndarray:
    """Pack integers in [0, n) into a uint8 array of `packed_nbytes(n, len(values))` bytes."""
    values = np.asarray(values).reshape(-1)
    bits = bits_for(n)
    if len(values) and (values.min() < 0 or values.max() >= n):
        raise ValueError(f"values must lie in [0, {n}), got [{values.min()}, {values.max()}]")
    if bits == 0 or not len(values):
        return np.zeros(0, dtype=np.uint8)
    if len(values) <= SMALL_ENTRIES:
        return _pack_bits(values, bits)
    plan = _group_plan(bits)
    chunks = []
    for start in range(0, len(values), CHUNK_ENTRIES):
        chunk = values[start : start + CHUNK_ENTRIES]
        groups = -(-len(chunk) // 64)
        # Column i holds entry i of every group (zero-padded: zeros add no bits).
        columns = np.zeros((groups, 64), dtype=np.uint64)
        columns.reshape(-1)[: len(chunk)] = chunk
        columns = _transposed(columns)
        words = np.zeros((bits, groups), dtype=np.uint64)
        for column, (word, shift, spills) in zip(columns, plan, strict=True):
            words[word] |= column << np.uint64(shift)
            if spills:
                words[word + 1] |= column >> np.uint64(64 - shift)
        # Group-major little-endian words are the bit stream; the padding's bytes are cut.
        stream = _transposed(words).astype("<u8", copy=False).view(np.uint8)
        chunks.append(stream.reshape(-1)[: packed_nbytes(n, len(chunk))])
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
    if count <= SMALL_ENTRIES:
        return _unpack_bits(packed, bits, count)
    plan = _group_plan(bits)
    mask = np.uint64((1 << bits) - 1)
    chunk_bytes = CHUNK_ENTRIES * bits // 8
    out = np.empty(count, dtype=np.int64)
    for chunk_index, start in enumerate(range(0, count, CHUNK_ENTRIES)):
        entries = min(CHUNK_ENTRIES, count - start)
        groups = -(-entries // 64)
        raw = packed[chunk_index * chunk_bytes : chunk_index * chunk_bytes + chunk_bytes]
        stream = np.zeros(groups * bits * 8, dtype=np.uint8)  # zero-padded to whole groups
        stream[: len(raw)] = raw
        words = _transposed(stream.view("<u8").reshape(groups, bits))
        columns = np.empty((64, groups), dtype=np.uint64)
        for column, (word, shift, spills) in zip(columns, plan, strict=True):
            np.right_shift(words[word], np.uint64(shift), out=column)
            if spills:
                column |= words[word + 1] << np.uint64(64 - shift)
            column &= mask
        out[start : start + entries] = _transposed(columns).reshape(-1)[:entries].view(np.int64)
    return out


def _pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """`pack` through a [len(values), bits] matrix of single bits, least significant first:
    row after row it is the bit stream, which packbits writes little-endian bit order."""
    shifts = np.arange(bits, dtype=np.uint64)
    matrix = (values.astype(np.uint64)[:, None] >> shifts) & np.uint64(1)
    return np.packbits(matrix.astype(np.uint8).reshape(-1), bitorder="little")


def _unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """`unpack` through the matrix of single bits: each row's bits times their powers of 2."""
    matrix = np.unpackbits(packed, count=count * bits, bitorder="little").reshape(count, bits)
    return matrix.astype(np.int64) @ (np.int64(1) << np.arange(bits, dtype=np.int64))


def _row_padding(n: int, entries: int) -> int:
    """Zero entries appended to each row so that rows * (entries + padding) entries make one bit
    stream whose every row starts on a byte boundary: (entries + padding) * bits % 8 == 0."""
    bits = bits_for(n)
    return next(p for p in range(8) if (entries + p) * bits % 8 == 0)


def pack_rows(rows: np.ndarray, n: int) -> np.ndarray:
    """`pack` of every row of the 2-D integer array `rows` (values in [0, n)): a uint8 array
    [len(rows), packed_nbytes(n, row length)] whose row i is `pack(rows[i], n)`, bit for bit.
    The rows, each zero-padded to a whole number of bytes (zeros add no bits), are packed as
    one stream by `pack`'s word-wise path (~4x faster than row by row for 1,000 rows of 2,048
    entries); each row's bytes are then its first packed_nbytes(n, entries)."""
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError(f"rows must be a 2-D array, got shape {rows.shape}")
    count, entries = rows.shape
    row_bytes = packed_nbytes(n, entries)
    if not count or not entries or bits_for(n) == 0:
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            pack(rows.reshape(-1), n)  # raises, naming the values' range
        return np.zeros((count, row_bytes), dtype=np.uint8)
    padding = _row_padding(n, entries)
    stream = rows
    if padding:
        stream = np.zeros((count, entries + padding), dtype=rows.dtype)
        stream[:, :entries] = rows
    packed = pack(stream.reshape(-1), n).reshape(count, -1)
    return np.ascontiguousarray(packed[:, :row_bytes]) if padding else packed


def unpack_rows(packed: np.ndarray, n: int, count: int) -> np.ndarray:
    """Inverse of `pack_rows`: `unpack(packed[i], n, count)` of every row of the 2-D uint8
    array `packed`, as one int64 array [len(packed), count] (one stream, as `pack_rows`)."""
    packed = np.asarray(packed)
    if packed.ndim != 2 or packed.dtype != np.uint8:
        raise ValueError(
            f"packed rows must be a 2-D uint8 array, got {packed.dtype} of shape {packed.shape}"
        )
    rows = len(packed)
    expected = packed_nbytes(n, count)
    if packed.shape[1] != expected:
        raise ValueError(
            f"packed rows have {packed.shape[1]} bytes; {count} entries of {bits_for(n)} bits "
            f"need {expected}"
        )
    if not rows or not count or bits_for(n) == 0:
        return np.zeros((rows, count), dtype=np.int64)
    padding = _row_padding(n, count)
    stream = packed
    if padding:
        stream = np.zeros((rows, (count + padding) * bits_for(n) // 8), dtype=np.uint8)
        stream[:, :expected] = packed
    values = unpack(stream.reshape(-1), n, rows * (count + padding)).reshape(rows, -1)
    return np.ascontiguousarray(values[:, :count]) if padding else values
