"""What a run draws: curves.png (a valid image with the run's curves) and TensorBoard's HParams
(the flattened config and the final metrics, readable by TensorBoard's own reader)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from raysim import config
from raysim.assembly import run


def test_a_run_writes_its_curves_and_hparams(tmp_path):
    cfg = config.load(
        "configs/fedavg_digits.yaml",
        [
            "runtime.backend=local",
            "run.rounds=3",
            "data.validation_fraction=0.1",
            "clients.lr=0.07",
        ],
    )
    result = run(cfg, tmp_path / "run", progress=False, tensorboard=True)
    with Image.open(tmp_path / "run" / "curves.png") as image:
        image.verify()  # a well-formed PNG
    with Image.open(tmp_path / "run" / "curves.png") as image:
        assert image.format == "PNG" and image.size == (1100, 400)
        pixels = np.asarray(image.convert("RGB"))
    # the curves are drawn in matplotlib's first colour (C0, #1f77b4), not only axes and text
    assert (np.abs(pixels.astype(int) - [31, 119, 180]).sum(axis=2) < 30).sum() > 200

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    contents = events.PluginTagToContent("hparams")
    session = next(
        plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
        for content in contents.values()
        if plugin_data_pb2.HParamsPluginData.FromString(content).HasField("session_start_info")
    )
    assert session.hparams["clients.lr"].number_value == 0.07
    assert session.hparams["algorithm.name"].string_value == "fedavg"
    assert session.hparams["data.validation_fraction"].number_value == 0.1
    scalars = set(events.Tags()["scalars"])
    assert {"final/accuracy", "final_val/accuracy", "val/accuracy", "eval/accuracy"} <= scalars
    final = events.Scalars("final/accuracy")[-1].value
    assert abs(final - result.summary["final"]["accuracy"]) < 1e-6
