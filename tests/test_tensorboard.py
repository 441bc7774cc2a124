"""TensorBoard event files hold, per round: global eval metrics, the client loss distribution,
update norms, bytes up/down, the round's time split and failures; read back with
tensorboard's EventAccumulator and compared with metrics.jsonl value for value."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from raysim.assembly import run
from raysim.outputs import RunOutputs
from raysim.outputs.tensorboard import heatmap_image, tensorboard_scalars

ROUNDS = 3


def _events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def _scalar_series(events, tag) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}


@pytest.fixture(scope="module")
def local_run(digits_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("tensorboard")
    config = digits_config(
        f"run.rounds={ROUNDS}", "partition.num_clients=20", "clients.per_round=4"
    )
    result = run(config, out, progress=False, tensorboard=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, records, _events(out / "tensorboard")


def test_every_listed_scalar_is_written_each_round_with_its_value(local_run):
    _, records, events = local_run
    tags = set(events.Tags()["scalars"])
    listed = {
        "eval/accuracy",  # global metrics
        "eval/loss",
        "train_loss",  # client loss distribution: the mean is what the record holds
        "clients/loss_mean",
        "update_norm_mean",  # update norms
        "bytes_up",  # bytes
        "bytes_down",
        "comm/bytes_up_per_client",
        "comm/bytes_down_per_client",
        "time/round_s",  # round time split
        "time/clients_s",
        "time/aggregate_s",
        "time/evaluate_s",
        "clients_failed",  # failures
        "clients/failure_rate",
    }
    # every key of the record's time split is logged, whatever keys the engine adds
    listed |= {f"time/{key}" for key in records[0]["time"]}
    assert listed <= tags, sorted(listed - tags)

    steps = list(range(1, ROUNDS + 1))
    expected = {record["round"]: tensorboard_scalars(record) for record in records}
    for tag in listed:
        series = _scalar_series(events, tag)
        assert sorted(series) == steps, tag
        for step in steps:  # event files store float32
            assert series[step] == pytest.approx(expected[step][tag], rel=1e-6, abs=1e-12), tag
    for record in records:
        step = record["round"]
        assert expected[step]["eval/accuracy"] == record["eval"]["accuracy"]
        assert expected[step]["clients/loss_mean"] == record["train_loss"]
        assert expected[step]["clients_failed"] == record["clients_failed"] == 0
        assert expected[step]["clients/failure_rate"] == 0.0
        assert expected[step]["comm/bytes_down_per_client"] == record["bytes_down"] / 4
        assert expected[step]["time/round_s"] == record["wall_s"]


def test_final_accuracy_event_equals_the_summary(local_run):
    result, _, events = local_run
    last = events.Scalars("eval/accuracy")[-1]
    assert last.step == ROUNDS
    assert last.value == pytest.approx(result.summary["final"]["accuracy"], rel=1e-6)


def test_per_client_lists_become_distribution_scalars_and_histograms(tmp_path, digits_config):
    """A record with per-client values (e.g. a future `client_losses`) gets min/median/mean/max
    scalars and a histogram; non-finite values are skipped."""
    outputs = RunOutputs(tmp_path, digits_config(), tensorboard=True)
    losses = [0.5, 2.0, 1.0, 4.0, math.nan]
    outputs.log_round({"round": 1, "train_loss": 1.5, "client_losses": losses, "clients": 5})
    outputs.log_heatmap("cmda/label_kl", np.array([[0.0, 1.0], [2.0, 0.0]]), step=1)
    outputs.close()
    events = _events(tmp_path / "tensorboard")
    values = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}
    assert values["client_losses/min"] == 0.5 and values["client_losses/max"] == 4.0
    assert values["client_losses/median"] == 1.5 and values["client_losses/mean"] == 1.875
    assert "client_losses" in events.Tags()["histograms"]
    (image,) = events.Images("cmda/label_kl")
    assert (image.width, image.height) == (256, 256)


def test_heatmap_image_maps_low_to_dark_and_high_to_yellow():
    image = heatmap_image(np.array([[0.0, 1.0]]), min_pixels=2)
    assert image.shape == (1, 2, 3) and image.dtype == np.uint8
    assert tuple(image[0, 0]) == (18, 10, 84) and tuple(image[0, 1]) == (252, 232, 36)
    with pytest.raises(ValueError, match="2-D"):
        heatmap_image(np.zeros(3))


def test_the_native_event_checksum_equals_tensorboards_own():
    """Event records are checksummed by google-crc32c (raysim.outputs._use_native_crc32c);
    TensorBoard's pure-Python masked CRC-32C is the reference, on every length class."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from raysim.outputs.tensorboard import _masked_crc32c

    rng = np.random.default_rng(0)
    for length in (0, 1, 3, 4, 7, 8, 9, 63, 64, 65, 1000, 4099):
        data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        assert _masked_crc32c(data) == masked_crc32c(data), length
