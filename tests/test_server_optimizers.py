"""Server optimizers (FedOpt): two steps of each against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raysim import registry
from raysim.config import ServerConfig
from raysim.core.server_optimizers import ServerAdagrad, ServerAdam, ServerSGD


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_sgd_lr1_momentum0_is_params_plus_delta_exactly():
    rng = np.random.default_rng(0)
    params = rng.standard_normal(1000).astype(np.float32)
    delta = rng.standard_normal(1000).astype(np.float32) * np.float32(1e-3)
    optimizer = ServerSGD(lr=1.0, momentum=0.0)
    slots = optimizer.init(params)
    assert slots == {}  # plain FedAvg keeps no server state
    new, slots = optimizer.step(params, delta, slots)
    assert new.dtype == np.float32 and slots == {}
    assert new.tobytes() == (params + delta).tobytes()


def test_sgd_with_momentum_two_steps():
    optimizer = ServerSGD(lr=0.5, momentum=0.5)
    params = f32(1.0, 1.0)
    slots = optimizer.init(params)
    np.testing.assert_array_equal(slots["momentum"], f32(0.0, 0.0))
    # step 1: v = d1 = [1, -2]; x = [1, 1] + 0.5 v = [1.5, 0]
    params, slots = optimizer.step(params, f32(1.0, -2.0), slots)
    np.testing.assert_array_equal(params, f32(1.5, 0.0))
    np.testing.assert_array_equal(slots["momentum"], f32(1.0, -2.0))
    # step 2: v = 0.5 [1, -2] + [2, 4] = [2.5, 3]; x = [1.5, 0] + 0.5 v = [2.75, 1.5]
    params, slots = optimizer.step(params, f32(2.0, 4.0), slots)
    np.testing.assert_array_equal(params, f32(2.75, 1.5))
    np.testing.assert_array_equal(slots["momentum"], f32(2.5, 3.0))
    assert params.dtype == np.float32


def test_adagrad_two_steps():
    optimizer = ServerAdagrad(lr=0.5, eps=1e-3)
    params = f32(1.0, -1.0)
    slots = optimizer.init(params)
    # step 1: s = [9, 16]; x += 0.5 * [3 / (3 + eps), -4 / (4 + eps)]
    params, slots = optimizer.step(params, f32(3.0, -4.0), slots)
    expected1 = [1.0 + 0.5 * 3 / (3 + 1e-3), -1.0 - 0.5 * 4 / (4 + 1e-3)]
    np.testing.assert_array_equal(slots["sum_squares"], f32(9.0, 16.0))
    assert params.tolist() == pytest.approx(expected1, rel=1e-6)
    # step 2: s = [9 + 16, 16 + 9] = [25, 25]; x += 0.5 * [4 / (5 + eps), 3 / (5 + eps)]
    params, slots = optimizer.step(params, f32(4.0, 3.0), slots)
    expected2 = [expected1[0] + 0.5 * 4 / (5 + 1e-3), expected1[1] + 0.5 * 3 / (5 + 1e-3)]
    np.testing.assert_array_equal(slots["sum_squares"], f32(25.0, 25.0))
    assert params.tolist() == pytest.approx(expected2, rel=1e-6)
    assert params.dtype == np.float32


def test_adagrad_eps_zero_is_exact():
    optimizer = ServerAdagrad(lr=0.5, eps=0.0)
    params, slots = optimizer.step(f32(1.0, 1.0), f32(3.0, -4.0), optimizer.init(f32(1.0, 1.0)))
    np.testing.assert_array_equal(params, f32(1.5, 0.5))  # 0.5 * sign(delta) on the first step


def test_adam_two_steps():
    lr, beta1, beta2, eps = 0.1, 0.9, 0.99, 1e-3
    optimizer = ServerAdam(lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    params = f32(0.0, 0.0)
    slots = optimizer.init(params)
    # step 1, delta [1, -2]: m = [0.1, -0.2]; v = [0.01, 0.04]; sqrt v = [0.1, 0.2]
    params, slots = optimizer.step(params, f32(1.0, -2.0), slots)
    expected1 = [0.1 * 0.1 / (0.1 + eps), 0.1 * -0.2 / (0.2 + eps)]
    assert slots["first_moment"].tolist() == pytest.approx([0.1, -0.2], rel=1e-6)
    assert slots["second_moment"].tolist() == pytest.approx([0.01, 0.04], rel=1e-6)
    assert params.tolist() == pytest.approx(expected1, rel=1e-6)
    # step 2, delta [0.5, 0]: m = 0.9 m + 0.1 d = [0.14, -0.18];
    # v = 0.99 v + 0.01 d^2 = [0.0099 + 0.0025, 0.0396] = [0.0124, 0.0396]
    params, slots = optimizer.step(params, f32(0.5, 0.0), slots)
    expected2 = [
        expected1[0] + 0.1 * 0.14 / (math.sqrt(0.0124) + eps),
        expected1[1] + 0.1 * -0.18 / (math.sqrt(0.0396) + eps),
    ]
    assert slots["first_moment"].tolist() == pytest.approx([0.14, -0.18], rel=1e-6)
    assert slots["second_moment"].tolist() == pytest.approx([0.0124, 0.0396], rel=1e-6)
    assert params.tolist() == pytest.approx(expected2, rel=1e-6)
    assert params.dtype == np.float32


def test_steps_do_not_modify_their_inputs():
    params, delta = f32(1.0, 2.0), f32(0.5, -0.5)
    for optimizer in (ServerSGD(lr=1.0, momentum=0.9), ServerAdagrad(), ServerAdam()):
        slots = optimizer.init(params)
        before = {k: v.copy() for k, v in slots.items()}
        optimizer.step(params, delta, slots)
        np.testing.assert_array_equal(params, f32(1.0, 2.0))
        np.testing.assert_array_equal(delta, f32(0.5, -0.5))
        for key, value in before.items():
            np.testing.assert_array_equal(slots[key], value)


def test_factories_read_the_server_config():
    server = ServerConfig(optimizer="adam", lr=0.2, momentum=0.3, beta1=0.8, beta2=0.95, eps=1e-4)
    assert registry.server_optimizers.build("sgd", server) == ServerSGD(lr=0.2, momentum=0.3)
    assert registry.server_optimizers.build("adagrad", server) == ServerAdagrad(lr=0.2, eps=1e-4)
    assert registry.server_optimizers.build("adam", server) == ServerAdam(
        lr=0.2, beta1=0.8, beta2=0.95, eps=1e-4
    )
