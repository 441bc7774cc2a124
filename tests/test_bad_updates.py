"""Bad client updates are rejected before aggregation, counted and logged with the client id.

Unit tests of raysim.core.validation for every algorithm's message format, then the server:
a client sending NaNs, a vector of the wrong shape or dtype, or FRL positions that are not a
permutation is skipped, and the round ends with exactly the state of the same round without
that client (np.array_equal), on the local backend, for FedAvg and FRL.
"""

from __future__ import annotations

import numpy as np
import pytest

from raysim.core import validation
from raysim.core.rankcodec import pack
from raysim.core.state import ClientUpdate
from raysim.core.validation import (
    DENSE,
    RANKS,
    SIGNS,
    SPARSE,
    UpdateSpec,
    check_decoded,
    check_message,
    not_a_permutation,
)

# --- the checks, one format at a time --------------------------------------------------------


def test_permutation_check_is_exact():
    n = 1000
    rng = np.random.default_rng(0)
    perm = rng.permutation(n).astype(np.int64)
    assert not_a_permutation(perm, n) is None
    repeated = perm.copy()
    repeated[5] = repeated[6]
    assert "repeats a position" in not_a_permutation(repeated, n)
    out_of_range = perm.copy()
    out_of_range[0] = n
    assert "out of range" in not_a_permutation(out_of_range, n)
    negative = perm.copy()
    negative[3] = -1
    assert "out of range" in not_a_permutation(negative, n)
    assert "has 999 entries" in not_a_permutation(perm[:-1], n)
    assert not_a_permutation(np.zeros(0, dtype=np.int64), 0) is None


DENSE_SPEC = UpdateSpec(DENSE, 6, np.dtype(np.float32))


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (np.zeros(6, dtype=np.float32), None),
        (np.array([0, 1, np.nan, 0, np.inf, 0], dtype=np.float32), "2 NaN/Inf entries"),
        (np.zeros(5, dtype=np.float32), "has 5 entries, expected 6"),
        (np.zeros((2, 3), dtype=np.float32), "shape (2, 3), expected 1-D"),
        (np.zeros(6, dtype=np.float64), "dtype float64, expected float32"),
        (np.zeros(6, dtype=np.int32), "dtype int32"),
        ([0.0] * 6, "is a list, expected a numpy array"),
        (None, "is a NoneType"),
    ],
)
def test_dense_updates(message, expected):
    problem = check_message(DENSE_SPEC, message) or (
        check_decoded(DENSE_SPEC, message) if isinstance(message, np.ndarray) else None
    )
    if expected is None:
        assert problem is None
    else:
        assert expected in problem


def test_sign_updates():
    spec = UpdateSpec(SIGNS, 20, np.dtype(np.int8))
    assert check_message(spec, np.zeros(3, dtype=np.uint8)) is None
    assert "has 2 entries, expected 3" in check_message(spec, np.zeros(2, dtype=np.uint8))
    assert "dtype" in check_message(spec, np.zeros(3, dtype=np.uint16))
    assert "dtype float32" in check_message(spec, np.zeros(3, dtype=np.float32))


def test_sparse_updates():
    spec = UpdateSpec(SPARSE, 10, np.dtype(np.float32), kept=3)

    def message(values=(1.0, -2.0, 0.5), indices=(0, 4, 9), dtype=np.float32):
        return {"values": np.array(values, dtype=dtype), "indices": np.array(indices, np.int32)}

    assert check_message(spec, message()) is None
    assert "strictly increasing" in check_message(spec, message(indices=(4, 4, 9)))
    assert "strictly increasing" in check_message(spec, message(indices=(9, 4, 0)))
    assert "out of range [0, 10)" in check_message(spec, message(indices=(0, 4, 10)))
    assert "out of range [0, 10)" in check_message(spec, message(indices=(-1, 4, 9)))
    assert "NaN/Inf" in check_message(spec, message(values=(1.0, np.nan, 0.5)))
    assert "expected float32" in check_message(spec, message(dtype=np.float64))
    assert "has 2 entries, expected 3" in check_message(spec, message((1.0, 2.0), (0, 1)))
    assert "keys ['indices']" in check_message(spec, {"indices": np.arange(3)})
    assert "got a ndarray" in check_message(spec, np.zeros(10, dtype=np.float32))


def test_rank_updates():
    sizes = (5, 300)
    spec = UpdateSpec(RANKS, sum(sizes), np.dtype(np.int64), layer_sizes=sizes)
    rng = np.random.default_rng(1)
    perms = [rng.permutation(n) for n in sizes]
    good = [pack(p, n) for p, n in zip(perms, sizes, strict=True)]
    assert check_message(spec, good) is None
    assert check_decoded(spec, np.concatenate(perms).astype(np.int64)) is None
    assert "has 1 layers, expected 2" in check_message(spec, good[:1])
    assert "layer 1 has 337 bytes, expected 338" in check_message(spec, [good[0], good[1][:-1]])
    assert "expected one packed array per layer" in check_message(spec, good[0])
    repeated = np.concatenate(perms).astype(np.int64)
    repeated[5 + 10] = repeated[5 + 11]
    assert "layer 1 positions are not a permutation: repeats" in check_decoded(spec, repeated)
    # 9 bits per entry hold up to 511: a position >= 300 is representable but out of range
    high = np.concatenate(perms).astype(np.int64)
    high[5 + 7] = 400
    assert "out of range [0, 300)" in check_decoded(spec, high)


def test_num_samples_must_be_a_count():
    for samples in (-1, 2.5, True, None):
        update = ClientUpdate(client_id=3, num_samples=samples, message=np.zeros(6, np.float32))
        assert "num_samples" in validation.check_update(DENSE_SPEC, update)
    fine = ClientUpdate(client_id=3, num_samples=np.int64(4), message=np.zeros(6, np.float32))
    assert validation.check_update(DENSE_SPEC, fine) is None
