"""Model factories: shapes, parameter counts, seeded init and the flat-vector round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim import config
from raysim.core.algorithm import RunContext
from raysim.errors import ConfigError
from raysim.models import classic
from raysim.models.vector import build_model, get_vector, set_vector, vector_size


@pytest.mark.parametrize(
    ("factory", "input_shape", "num_params"),
    [
        # 64*128+128 + 128*10+10
        (classic.mlp, (64,), 9_610),
        # conv 1->32 (320) + conv 32->64 (18,496) + fc 9216->128 (1,179,776) + fc 128->10 (1,290)
        (classic.lenet, (1, 28, 28), 1_199_882),
        (classic.conv2, (3, 32, 32), 4_301_642),
        (classic.conv4, (3, 32, 32), 2_425_930),
        (classic.conv8, (3, 32, 32), 5_278_282),
    ],
)
def test_models_have_the_expected_size_and_output(factory, input_shape, num_params):
    model = factory(input_shape, 10)
    assert sum(p.numel() for p in model.parameters()) == num_params
    assert model(torch.zeros(2, *input_shape)).shape == (2, 10)


def test_image_models_reject_flat_inputs_with_a_clear_error():
    cfg = config.from_dict({}, ["model.name=lenet"])
    with pytest.raises(ConfigError, match=r"model 'lenet'.*channels, height, width"):
        build_model(RunContext(cfg, (64,), 10))


def test_init_depends_only_on_the_seed_and_vectors_round_trip():
    cfg = config.from_dict({}, ["model.name=mlp"])
    first = get_vector(build_model(RunContext(cfg, (64,), 10)))
    again = get_vector(build_model(RunContext(cfg, (64,), 10)))
    other = get_vector(build_model(RunContext(cfg.replace(run__seed=1), (64,), 10)))
    assert first.dtype == np.float32 and first.shape == (9_610,)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    model = build_model(RunContext(cfg, (64,), 10))
    values = np.arange(vector_size(model), dtype=np.float32)
    set_vector(model, values)
    assert np.array_equal(get_vector(model), values)
    with pytest.raises(ValueError, match="9609 values, model needs 9610"):
        set_vector(model, values[:-1])
