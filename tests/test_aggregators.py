"""Aggregators: exact values on hand-computed vectors; streaming == batch, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from raysim import registry
from raysim.core.aggregators import (
    LinearAccumulator,
    Mean,
    Sum,
    WeightedMean,
    contributions_of,
    mean,
    total,
    weighted_mean,
)


def _vectors(*rows) -> list[np.ndarray]:
    return [np.asarray(row, dtype=np.float32) for row in rows]


def test_mean_hand_computed():
    vectors = [
        np.array([1.0, 2.0, -4.0], np.float32),
        np.array([3.0, 6.0, 0.0], np.float32),
        np.array([5.0, -2.0, 1.0], np.float32),
    ]
    result = mean(vectors)
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, np.array([3.0, 2.0, -1.0], np.float32))


def test_weighted_mean_hand_computed():
    vectors = [np.array([1.0, 2.0], np.float32), np.array([3.0, 6.0], np.float32)]
    # (1*1 + 3*3) / 4 = 2.5 and (1*2 + 3*6) / 4 = 5
    np.testing.assert_array_equal(weighted_mean(vectors, [1, 3]), np.array([2.5, 5.0], np.float32))
    # a zero weight drops a client; weights need not be integers
    np.testing.assert_array_equal(weighted_mean(vectors, [0.0, 0.5]), vectors[1])
    np.testing.assert_array_equal(
        weighted_mean(vectors, [0.25, 0.25]), np.array([2.0, 4.0], np.float32)
    )


def test_weighted_mean_is_computed_in_float64():
    # 2^24 + 1 is not a float32; a float32 running sum would lose the 1.
    vectors = [
        np.array([2.0**24], np.float32),
        np.array([1.0], np.float32),
        np.array([-(2.0**24)], np.float32),
    ]
    assert mean(vectors)[0] == np.float32(1 / 3)


@pytest.mark.parametrize("block_bytes", [1, 8 * 64, 32 * 1024 * 1024])
def test_add_rows_is_add_row_by_row_bit_for_bit(monkeypatch, block_bytes):
    """A WireChunk's rows folded a block at a time (Server's chunk path) give the sums of
    folding them one at a time: one row a block, a few, all."""
    from raysim.core import aggregators

    monkeypatch.setattr(aggregators, "ROWS_BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(7)
    for trial in range(10):
        count, size = int(rng.integers(1, 40)), int(rng.integers(1, 300))
        rows = (rng.standard_normal((count, size)) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
        rows[rng.integers(count), 0] = -0.0  # signed zeros must survive as the loop adds them
        weights = [float(w) for w in rng.integers(0, 50, size=count)]
        if trial % 2:
            weights = [np.float32(w) * 0.37 for w in weights]  # weights of another type
        one_by_one, at_once = LinearAccumulator(), LinearAccumulator()
        head = int(rng.integers(0, count))  # a running total from earlier updates first
        for row, weight in zip(rows[:head], weights[:head], strict=True):
            one_by_one.add(row, weight)
            at_once.add(row, weight)
        for row, weight in zip(rows[head:], weights[head:], strict=True):
            one_by_one.add(row, weight)
        at_once.add_rows(rows[head:], weights[head:])
        assert at_once.total.tobytes() == one_by_one.total.tobytes(), trial
        assert at_once.weight_sum == one_by_one.weight_sum and at_once.count == count
    # integer rows take the integer path, row by row
    votes = rng.integers(-5, 5, size=(6, 8))
    exact, rowwise = LinearAccumulator(normalize=False), LinearAccumulator(normalize=False)
    exact.add_rows(votes, [1] * 6)
    for row in votes:
        rowwise.add(row, 1)
    assert exact.total.dtype == np.int64 and np.array_equal(exact.total, rowwise.total)
    with pytest.raises(ValueError, match="3 rows but 2 weights"):
        LinearAccumulator().add_rows(rows[:3], [1.0, 1.0])


def test_streaming_accumulator_equals_pure_function_bit_for_bit():
    rng = np.random.default_rng(1234)
    for trial in range(20):
        count = int(rng.integers(1, 12))
        size = int(rng.integers(1, 500))
        vectors = [
            (rng.standard_normal(size) * 10.0 ** rng.integers(-4, 4)).astype(np.float32)
            for _ in range(count)
        ]
        weights = rng.integers(1, 200, size=count).astype(float)
        accumulator = LinearAccumulator()
        # fold in as the server does: updates arrive in chunks (one per task), client-id order
        cuts = sorted({*rng.choice(np.arange(1, count + 1), size=min(count, 3)).tolist(), count})
        start = 0
        for stop in cuts:
            for vector, weight in zip(vectors[start:stop], weights[start:stop], strict=True):
                accumulator.add(vector, weight)
            start = stop
        streamed = accumulator.result()
        batch = weighted_mean(vectors, weights)
        assert accumulator.count == count and accumulator.weight_sum == weights.sum()
        assert streamed.dtype == batch.dtype == np.float32
        assert streamed.tobytes() == batch.tobytes(), f"trial {trial}"
        # and both agree with an independent float64 reference (to float32 rounding)
        reference = np.average(np.stack(vectors).astype(np.float64), axis=0, weights=weights)
        np.testing.assert_allclose(batch, reference, rtol=1e-6, atol=1e-6 * np.abs(reference).max())


def test_weighted_mean_class_weights_by_num_samples():
    vectors = _vectors([1.0, 0.0], [0.0, 1.0], [2.0, 2.0])
    samples = [10, 30, 60]
    aggregator = WeightedMean()
    assert aggregator.linear is True
    contributions = contributions_of(vectors, samples)
    assert [aggregator.weight(c) for c in contributions] == [10.0, 30.0, 60.0]
    # (10*1 + 60*2) / 100 = 1.3, (30*1 + 60*2) / 100 = 1.5
    np.testing.assert_array_equal(
        aggregator.aggregate(contributions), np.array([1.3, 1.5], np.float32)
    )
    uniform = Mean()
    assert uniform.linear is True
    assert [uniform.weight(c) for c in contributions] == [1.0, 1.0, 1.0]
    np.testing.assert_array_equal(
        uniform.aggregate(contributions), np.array([1.0, 1.0], np.float32)
    )


def test_aggregator_classes_equal_streaming_fold():
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(64).astype(np.float32) for _ in range(9)]
    samples = [int(n) for n in rng.integers(1, 50, size=9)]
    for aggregator in (WeightedMean(), Mean()):
        accumulator = LinearAccumulator()
        contributions = contributions_of(vectors, samples)
        for contribution in contributions:
            accumulator.add(contribution.update, aggregator.weight(contribution))
        assert accumulator.result().tobytes() == aggregator.aggregate(contributions).tobytes()


def test_integer_sums_are_exact_and_independent_of_grouping():
    rng = np.random.default_rng(3)
    vectors = [rng.permutation(1000).astype(np.int32) for _ in range(7)]
    whole = total(vectors)
    assert whole.dtype == np.int64
    np.testing.assert_array_equal(whole, np.sum(np.stack(vectors).astype(np.int64), axis=0))
    # any grouping (as tasks that pre-sum their clients would make) gives the same integers
    regrouped = total([total(vectors[:3]), total(vectors[3:])])
    assert regrouped.tobytes() == whole.tobytes()
    assert (
        Sum().aggregate(contributions_of(vectors, [5] * 7)).tobytes() == whole.tobytes()
    )  # unweighted


def test_registry_builds_the_aggregators():
    assert isinstance(registry.aggregators.build("mean"), Mean)
    assert isinstance(registry.aggregators.build("weighted_mean"), WeightedMean)


def test_zero_total_weight_raises():
    vector = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="no client update with positive weight"):
        weighted_mean([vector, vector], [0, 0])
    with pytest.raises(ValueError, match="no client update with positive weight"):
        mean([])
    with pytest.raises(ValueError, match="no client update with positive weight"):
        WeightedMean().aggregate(contributions_of(_vectors([1.0], [2.0]), [0, 0]))
    with pytest.raises(ValueError, match="no client update with positive weight"):
        LinearAccumulator().result()


def test_mismatched_weights_raise():
    with pytest.raises(ValueError, match="2 vectors but 1 weights"):
        weighted_mean([np.zeros(2, np.float32)] * 2, [1.0])
