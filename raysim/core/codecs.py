"""Codecs: the wire formats of client updates (encode / check / decode / byte count).

A client's algorithm produces its update as a flat vector (a FedAvg delta, FRL's rank
positions); the run's codec turns it into what crosses the wire (`encode`, in the client task),
and back into the dense vector the aggregator sees (`decode`, on the server). Before decoding,
the server asks the codec whether a message is well formed (`check`): a buggy or hostile client
can send anything. The engine then checks the decoded vector generically (1-D, the layout's
size, the codec's `decoded_dtype`, finite) and, where the codec has one, with its
`check_decoded` (FRL: every layer a permutation).

What the vector looks like comes from the algorithm (`update_layout(ctx) -> VectorLayout`): its
size, dtype and the sizes of its consecutive pieces (a model's tensors, FRL's layers), so a
codec can quantise per tensor or pack per layer without knowing the algorithm.

A codec is a plug-in like any other (`codec: {name: mymodule:Int8Codec, ...options}`); config
`codec.name: auto` takes the algorithm's `default_codec`. Built in:
    dense  float32 vector as it is (FedAvg, FedProx, the multi-label family)
    signs  one bit per entry, 1 for >= 0 (SignSGD); decodes to int8 +1/-1
    topk   the `fraction` largest-magnitude entries as float32 values at int32 indices
    ranks  FRL's rank positions, bit-packed per layer; decodes to int64, each layer a permutation
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from raysim.core.payload import encoded_nbytes
from raysim.core.rankcodec import pack, pack_rows, packed_nbytes, unpack, unpack_rows
from raysim.errors import ConfigError
from raysim.models.layout import VectorLayout  # the update vector's shape, in signatures


class Codec:
    """Base class of codecs: override `encode`, `decode` and `check` (and `decoded_dtype`)."""

    # dtype of `decode`'s result (None: any numeric dtype is accepted)
    def decoded_dtype(self, layout: VectorLayout) -> np.dtype | None:
        return layout.dtype

    def encode(self, vector: np.ndarray, layout: VectorLayout) -> Any:
        raise NotImplementedError

    def decode(self, message: Any, layout: VectorLayout) -> np.ndarray:
        raise NotImplementedError

    def check(self, message: Any, layout: VectorLayout) -> str | None:
        """Why `message` is malformed (one line), or None. Cheap: runs before decoding."""
        return None

    def check_decoded(self, vector: np.ndarray, layout: VectorLayout) -> str | None:
        """Checks of the decoded vector beyond shape, dtype and finiteness (None: fine)."""
        return None

    def nbytes(self, message: Any) -> int:
        """Bytes on the wire (the arrays of the message)."""
        return encoded_nbytes(message)

    # --- rows: several clients' vectors at once (raysim.core.wire_chunk) ------------------------
    # Only the built-in dense and ranks codecs stack (`wire_chunk.stacks`): a subclass may encode
    # or check differently. `encode_rows` of a 2-D array of vectors returns their messages as an
    # array of rows (dense), or as a tuple of arrays of rows (ranks: one per layer) whose row i
    # together is `encode(rows[i])`; `decode_rows` reverses it into a 2-D array whose row i is
    # `decode` of client i's message, and `rows_pass_decoded` says whether every decoded row
    # passes `check_decoded` (False: the server then judges the rows one by one).
    row_kinds = ""  # dtype kinds of the vectors `encode_rows` takes ("": it takes none)

    def encode_rows(self, rows: np.ndarray, layout: VectorLayout) -> Any:
        raise NotImplementedError

    def decode_rows(self, stacked: Any, layout: VectorLayout) -> np.ndarray:
        raise NotImplementedError

    def rows_pass_decoded(self, rows: np.ndarray, layout: VectorLayout) -> bool:
        return True


class ForeignCodec(Codec):
    """A plug-in codec that does not subclass Codec, wrapped once (`as_codec`): the optional
    methods it lacks (`check`, `check_decoded`, `nbytes`, `decoded_dtype`) take Codec's
    defaults, so the engine calls every codec the same way."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encode = inner.encode
        self.decode = inner.decode
        for name in ("decoded_dtype", "check", "check_decoded", "nbytes"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def __repr__(self) -> str:
        return f"ForeignCodec({self.inner!r})"


def as_codec(codec: Any) -> Codec:
    """`codec` as a Codec: itself if it subclasses Codec, else wrapped in a ForeignCodec."""
    return codec if isinstance(codec, Codec) else ForeignCodec(codec)


# --- shared checks -------------------------------------------------------------------------------


def array_problem(name: str, value: Any, dtype_kinds: str, length: int | None) -> str | None:
    """Is `value` a 1-D ndarray with a dtype of one of `dtype_kinds` and `length` entries?"""
    if not isinstance(value, np.ndarray):
        return f"{name} is a {type(value).__name__}, expected a numpy array"
    if value.dtype.kind not in dtype_kinds:
        return f"{name} has dtype {value.dtype}"
    if value.ndim != 1:
        return f"{name} has shape {value.shape}, expected 1-D"
    if length is not None and len(value) != length:
        return f"{name} has {len(value)} entries, expected {length}"
    return None


def non_finite(name: str, vector: np.ndarray) -> str | None:
    """Where `vector` (a float array) holds NaN/Inf, or None."""
    if vector.dtype.kind != "f":
        return None
    finite = np.isfinite(vector)
    if finite.all():
        return None
    bad = len(vector) - int(np.count_nonzero(finite))
    first = int(np.argmin(finite))
    return f"{name} has {bad} NaN/Inf entries (first at index {first}: {vector[first]})"


def not_a_permutation(values: np.ndarray, n: int) -> str | None:
    """None when `values` is a permutation of 0..n-1, else why not. O(n), no sort."""
    if len(values) != n:
        return f"has {len(values)} entries, expected {n}"
    if n == 0:
        return None
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= n:
        return f"has a value out of range [0, {n}) (min {low}, max {high})"
    seen = np.zeros(n, dtype=bool)
    seen[values] = True
    if not seen.all():  # n values in range, one missing => another repeated
        return f"repeats a position ({n - int(np.count_nonzero(seen))} of 0..{n - 1} missing)"
    return None


def rows_are_permutations(rows: np.ndarray, n: int) -> bool:
    """Whether every row of the 2-D integer array `rows` is a permutation of 0..n-1
    (`not_a_permutation` of each row is None), in whole-array passes."""
    count = len(rows)
    if rows.shape[1] != n:
        return False
    if not count or not n:
        return True
    if rows.min() < 0 or rows.max() >= n:
        return False
    seen = np.zeros((count, n), dtype=bool)
    seen[np.arange(count)[:, None], rows] = True
    return bool(seen.all())


# --- the built-in codecs -------------------------------------------------------------------------


class Dense(Codec):
    """The vector as it is (float32 for model deltas): 4 bytes an entry."""

    row_kinds = "f"

    def encode_rows(self, rows: np.ndarray, layout: VectorLayout) -> np.ndarray:
        return rows  # (uncopied: the chunk's own array travels)

    def decode_rows(self, stacked: np.ndarray, layout: VectorLayout) -> np.ndarray:
        return stacked

    def encode(self, vector: np.ndarray, layout: VectorLayout) -> np.ndarray:
        return vector

    def decode(self, message: np.ndarray, layout: VectorLayout) -> np.ndarray:
        return message

    def check(self, message: Any, layout: VectorLayout) -> str | None:
        problem = array_problem("update", message, "f", layout.size)
        if problem is None and layout.dtype is not None and message.dtype != layout.dtype:
            problem = f"update has dtype {message.dtype}, expected {layout.dtype}"
        return problem


class Signs(Codec):
    """One bit per entry (1 for >= 0, 0 for < 0; a zero is sent as +1): ceil(d / 8) bytes."""

    def decoded_dtype(self, layout: VectorLayout) -> np.dtype:
        return np.dtype(np.int8)

    def encode(self, vector: np.ndarray, layout: VectorLayout) -> np.ndarray:
        return pack_signs(vector)

    def decode(self, message: np.ndarray, layout: VectorLayout) -> np.ndarray:
        return unpack_signs(message, layout.size if layout.size is not None else 8 * len(message))

    def check(self, message: Any, layout: VectorLayout) -> str | None:
        length = None if layout.size is None else (layout.size + 7) // 8
        return array_problem("packed signs", message, "u", length) or (
            None if message.dtype == np.uint8 else f"packed signs have dtype {message.dtype}"
        )


def pack_signs(vector: np.ndarray) -> np.ndarray:
    """One bit per entry: 1 for >= 0, 0 for < 0; ceil(len / 8) bytes (uint8)."""
    return np.packbits(np.asarray(vector) >= 0)


def unpack_signs(bits: np.ndarray, size: int) -> np.ndarray:
    """The int8 vector of +1 / -1 that `pack_signs` encoded."""
    if len(bits) != (size + 7) // 8:
        raise ValueError(f"{len(bits)} bytes of signs cannot hold exactly {size} parameters")
    return (2 * np.unpackbits(bits, count=size).astype(np.int8) - 1).astype(np.int8)


class TopK(Codec):
    """The k = round(fraction * d) largest-magnitude entries (at least one): float32 values at
    int32 indices, ascending; exactly 8k bytes. Decodes to a dense float32 vector."""

    def __init__(self, *, fraction: float = 0.1) -> None:
        if not 0 < fraction <= 1:
            raise ConfigError(f"'codec.fraction' must be in (0, 1], got {fraction}")
        self.fraction = float(fraction)

    def decoded_dtype(self, layout: VectorLayout) -> np.dtype:
        return np.dtype(np.float32)

    def encode(self, vector: np.ndarray, layout: VectorLayout) -> dict[str, np.ndarray]:
        return top_k(vector, num_kept(len(vector), self.fraction))

    def decode(self, message: dict[str, np.ndarray], layout: VectorLayout) -> np.ndarray:
        dense = np.zeros(layout.size, dtype=np.float32)
        dense[message["indices"]] = message["values"]
        return dense

    def check(self, message: Any, layout: VectorLayout) -> str | None:
        if not isinstance(message, Mapping) or set(message) != {"values", "indices"}:
            keys = sorted(map(str, message)) if isinstance(message, Mapping) else None
            found = f"keys {keys}" if keys is not None else f"a {type(message).__name__}"
            return f"expected a mapping with keys 'values' and 'indices', got {found}"
        kept = None if layout.size is None else num_kept(layout.size, self.fraction)
        values, indices = message["values"], message["indices"]
        problem = array_problem("values", values, "f", kept) or array_problem(
            "indices", indices, "iu", len(values) if isinstance(values, np.ndarray) else None
        )
        if problem:
            return problem
        if values.dtype != np.float32:
            return f"values have dtype {values.dtype}, expected float32"
        if len(indices) and layout.size is not None:
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= layout.size:
                return f"an index is out of range [0, {layout.size}) (min {low}, max {high})"
        if len(indices) > 1 and not (np.diff(indices.astype(np.int64)) > 0).all():
            return "indices are not strictly increasing (repeated or unsorted)"
        return non_finite("values", values)


def num_kept(size: int, fraction: float) -> int:
    """k = round(fraction * size), at least 1."""
    return max(1, min(size, round(fraction * size)))


def top_k(vector: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """The k largest-magnitude entries: float32 values at int32 indices (ascending indices).

    Ties in magnitude go to the lower index (a stable sort), so the message is deterministic.
    """
    order = np.argsort(-np.abs(vector), kind="stable")[:k]
    indices = np.sort(order).astype(np.int32)
    return {"values": vector[indices].astype(np.float32), "indices": indices}


def _layers(message, layout: VectorLayout) -> list[tuple[Any, int]]:
    """(a ranks message's layer, its entries) pairs; ValueError when the layer count is not
    the supernet's."""
    if len(message) != len(layout.segments):
        raise ValueError(
            f"message has {len(message)} layers, the supernet has {len(layout.segments)}"
        )
    return list(zip(message, layout.segments, strict=True))


class Ranks(Codec):
    """Rank positions, one bit-packed array per layer (ceil(log2 n) bits an entry); the layout's
    segments are the layers. Decodes to one int64 vector; each layer must be a permutation."""

    row_kinds = "iu"

    def decoded_dtype(self, layout: VectorLayout) -> np.dtype:
        return np.dtype(np.int64)

    def encode(self, vector: np.ndarray, layout: VectorLayout) -> list[np.ndarray]:
        return [
            pack(piece, n) for piece, n in zip(layout.pieces(vector), layout.segments, strict=True)
        ]

    def encode_rows(self, rows: np.ndarray, layout: VectorLayout) -> tuple[np.ndarray, ...]:
        """Each layer's packed positions of every row, one uint8 array [rows, bytes] a layer."""
        return tuple(
            pack_rows(piece, n)
            for piece, n in zip(layout.pieces(rows), layout.segments, strict=True)
        )

    def decode_rows(self, stacked: tuple[np.ndarray, ...], layout: VectorLayout) -> np.ndarray:
        return np.concatenate(
            [unpack_rows(packed, n, n) for packed, n in _layers(stacked, layout)], axis=1
        )

    def rows_pass_decoded(self, rows: np.ndarray, layout: VectorLayout) -> bool:
        """Every row's every layer a permutation (`check_decoded` of each row, at once)."""
        return all(
            rows_are_permutations(piece, n)
            for piece, n in zip(layout.pieces(rows), layout.segments, strict=True)
        )

    def decode(self, message: list[np.ndarray], layout: VectorLayout) -> np.ndarray:
        return np.concatenate([unpack(packed, n, n) for packed, n in _layers(message, layout)])

    def check(self, message: Any, layout: VectorLayout) -> str | None:
        if not isinstance(message, list | tuple):
            return f"expected one packed array per layer, got a {type(message).__name__}"
        if len(message) != len(layout.segments):
            return f"has {len(message)} layers, expected {len(layout.segments)}"
        for layer, (packed, n) in enumerate(zip(message, layout.segments, strict=True)):
            problem = array_problem(f"layer {layer}", packed, "u", None)
            if problem:
                return problem
            if packed.dtype != np.uint8:
                return f"layer {layer} has dtype {packed.dtype}, expected uint8"
            if len(packed) != packed_nbytes(n):
                return (
                    f"layer {layer} has {len(packed)} bytes, expected {packed_nbytes(n)} "
                    f"({n} bit-packed positions)"
                )
        return None

    def check_decoded(self, vector: np.ndarray, layout: VectorLayout) -> str | None:
        for layer, (piece, n) in enumerate(
            zip(layout.pieces(vector), layout.segments, strict=True)
        ):
            problem = not_a_permutation(piece, n)
            if problem:
                return f"layer {layer} positions are not a permutation: {problem}"
        return None


# Registry entries (raysim.registry.codecs): factories whose keyword-only parameters are options.
def dense() -> Dense:
    """The update as it is: float32, 4 bytes an entry."""
    return Dense()


def signs() -> Signs:
    """One bit per entry, the sign (SignSGD); decodes to int8 +1/-1."""
    return Signs()


def topk(*, fraction: float = 0.1) -> TopK:
    """The `fraction` largest-magnitude entries as float32 values at int32 indices."""
    return TopK(fraction=fraction)


def ranks() -> Ranks:
    """Rank positions bit-packed per layer, each layer checked to be a permutation (FRL)."""
    return Ranks()


class SharedEntries(Codec):
    """Personal layers: only the entries marked `shared` cross the wire, in the inner codec;
    the entries that stay on the client decode to zero (the algorithm's `shared_mask`)."""

    def __init__(self, inner: Any, shared: np.ndarray) -> None:
        self.inner = as_codec(inner)
        self.shared = np.asarray(shared, dtype=bool)

    def _inner_layout(self, layout: VectorLayout) -> VectorLayout:
        return VectorLayout(int(np.count_nonzero(self.shared)), layout.dtype)

    def decoded_dtype(self, layout: VectorLayout) -> np.dtype | None:
        return self.inner.decoded_dtype(self._inner_layout(layout))

    def encode(self, vector: np.ndarray, layout: VectorLayout) -> Any:
        return self.inner.encode(vector[self.shared], self._inner_layout(layout))

    def decode(self, message: Any, layout: VectorLayout) -> np.ndarray:
        part = self.inner.decode(message, self._inner_layout(layout))
        full = np.zeros(len(self.shared), dtype=part.dtype)
        full[self.shared] = part
        return full

    def check(self, message: Any, layout: VectorLayout) -> str | None:
        return self.inner.check(message, self._inner_layout(layout))

    def nbytes(self, message: Any) -> int:
        return int(self.inner.nbytes(message))
