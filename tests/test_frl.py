"""FRL (Federated Rank Learning): supermask layers, rank codec, the vote, and whole runs.

Read as the spec of raysim/algorithms/frl.py: the straight-through mask, the top-k rule, the
score reordering s[R_g[j]] = sort(s0)[j], the vote R_g = argsort(sum_u argsort(R_u)) on a
hand-computed example, exact bit-packed byte counts, regeneration of the supernet from the seed
in another process, and bit-identical rankings on the local and Ray backends.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from raysim import config
from raysim.algorithms.frl import FRL, positions_of, ranking_of, vote
from raysim.assembly import run
from raysim.core import rankcodec
from raysim.core.aggregators import total
from raysim.core.algorithm import RunContext
from raysim.core.validation import wire_format
from raysim.errors import ConfigError
from raysim.models.supermask import (
    SupermaskConv2d,
    SupermaskLinear,
    build_supernet,
    cached_supernet,
    clear_supernet_cache,
    supermask_layers,
    top_k_mask,
)
from raysim.seeds import model_init_seed

REPO_ROOT = Path(__file__).resolve().parents[1]
FRL_CONFIG = REPO_ROOT / "configs" / "frl_digits.yaml"
# A cheap FRL run for the tests: MLP 64-128-10 supermask (9,472 edges), 20 rounds (~1 s).
SHORT = ("runtime.backend=local", "run.rounds=20", "model.hidden=[128]", "run.checkpoint_every=0")
LAYER_SIZES = [64 * 128, 128 * 10]


def _frl_config(*overrides: str) -> config.Config:
    return config.load(FRL_CONFIG, [*SHORT, *overrides])


def _ctx(cfg: config.Config, input_shape=(64,), num_classes=10) -> RunContext:
    return RunContext(config=cfg, input_shape=tuple(input_shape), num_classes=num_classes)


def _supernet_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for layer in supermask_layers(model):
        digest.update(layer.weight.detach().numpy().tobytes())
        digest.update(layer.scores.detach().numpy().tobytes())
    return digest.hexdigest()


# --- the supermask layer -------------------------------------------------------------------------


def test_straight_through_gradient_equals_the_gradient_of_the_mask():
    """Signed rule: d loss / d scores = d loss / d m, with m the top-k mask and the forward
    using w * m."""
    torch.manual_seed(0)
    layers = [
        (SupermaskLinear(6, 4, k=0.5), torch.randn(5, 6)),
        (SupermaskConv2d(2, 3, 3, padding=1, k=0.3), torch.randn(2, 2, 5, 5)),
    ]
    for layer, x in layers:
        with torch.no_grad():
            layer.weight.normal_()
            layer.scores.normal_()
        target = torch.randn_like(layer(x))
        (layer(x) * target).sum().backward()
        # By hand: the same forward with the mask as a leaf tensor, w * m explicitly.
        mask = top_k_mask(layer.scores, layer.k).requires_grad_()
        weight = layer.weight * mask
        if isinstance(layer, SupermaskLinear):
            out = nn.functional.linear(x, weight)
        else:
            out = nn.functional.conv2d(x, weight, padding=1)
        (out * target).sum().backward()
        assert layer.weight.grad is None  # weights are fixed buffers, never trained
        assert torch.equal(layer.scores.grad, mask.grad)
        assert mask.grad.abs().sum() > 0


class _ReferenceSubnet(torch.autograd.Function):
    """Written from the FRL reference code's description (`models/module_util.py`
    GetSubnet): sort the key, zero the lowest int((1 - k) n), one for the rest; the backward
    returns g unchanged. The reference calls it on `scores.abs()` (`models/modules.py`), so
    autograd then multiplies by d|s| / ds. Nothing of raysim's mask is used here."""

    @staticmethod
    def forward(ctx, key, k):
        out = torch.empty_like(key)
        order = key.flatten().sort(stable=True).indices
        dropped = int((1 - k) * key.numel())
        flat = out.view(-1)
        flat[order[:dropped]] = 0
        flat[order[dropped:]] = 1
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


def _reference_output(layer, x, scores):
    """The reference forward of a supermask layer with `scores` (a leaf), by |s|."""
    weight = layer.weight * _ReferenceSubnet.apply(scores.abs(), layer.k)
    if isinstance(layer, SupermaskLinear):
        return nn.functional.linear(x, weight)
    return nn.functional.conv2d(x, weight, padding=layer.padding)


@pytest.mark.parametrize("driver", ["one client", "vmapped (given mask)"])
def test_mask_by_abs_gradient_is_the_reference_codes_sign_times_g(driver):
    """mask_by_abs: the masks and the score gradients equal the reference's (straight through
    |s|: sign(s) * g), for a 6x4 linear layer and a conv layer, on both drivers' paths: the
    layer computing its own mask (one client at a time) and the mask handed in by the vmapped
    driver (`given_mask`, computed by `top_k_masks`)."""
    from raysim.models.supermask import top_k_masks

    torch.manual_seed(0)
    layers = [
        (SupermaskLinear(6, 4, k=0.5, mask_by_abs=True), torch.randn(5, 6)),
        (SupermaskConv2d(2, 3, 3, padding=1, k=0.3, mask_by_abs=True), torch.randn(2, 2, 5, 5)),
    ]
    for layer, x in layers:
        with torch.no_grad():
            layer.weight.normal_()
            layer.scores.normal_()  # symmetric around 0: about half the scores negative
        assert (layer.scores < 0).any() and (layer.scores > 0).any()
        if driver != "one client":
            layer.given_mask = top_k_masks(layer.scores.detach()[None], layer.k, True)[0]
        target = torch.randn_like(layer(x))
        (layer(x) * target).sum().backward()

        scores = layer.scores.detach().clone().requires_grad_()
        (_reference_output(layer, x, scores) * target).sum().backward()
        expected_mask = _ReferenceSubnet.apply(scores.detach().abs(), layer.k)
        assert torch.equal(layer.mask().detach(), expected_mask)
        assert torch.equal(layer.scores.grad, scores.grad)
        # the signed rule's gradient (the mask's) differs exactly by sign(s)
        negative = layer.scores.detach() < 0
        assert scores.grad[negative].abs().sum() > 0
        mask_grad = scores.grad * torch.sign(scores.detach())
        assert not torch.equal(layer.scores.grad, mask_grad)
        layer.given_mask = None


@pytest.mark.parametrize("k", [0.1, 0.25, 0.5, 0.7, 0.9, 1.0])
def test_top_k_mask_keeps_exactly_the_int_rule_count_per_layer(k):
    model = build_supernet("conv2", (1, 8, 8), 10, seed=3, k=k)
    for layer in supermask_layers(model):
        n = layer.scores.numel()
        mask = top_k_mask(layer.scores, layer.k)
        assert int(mask.sum()) == n - int((1 - k) * n)
        kept, dropped = layer.scores[mask == 1], layer.scores[mask == 0]
        if len(dropped):
            assert kept.min() >= dropped.max()  # the kept edges are the highest-scored


def test_top_k_mask_by_abs_and_ties_follow_the_stable_sort():
    scores = torch.tensor([0.3, -0.9, 0.1, -0.2, 0.5, 0.0])
    # signed: drop the 3 lowest (-0.9, -0.2, 0.0)
    assert top_k_mask(scores, 0.5).tolist() == [1, 0, 1, 0, 1, 0]
    # by |s|: drop the 3 smallest magnitudes (0.0, 0.1, -0.2)
    assert top_k_mask(scores, 0.5, mask_by_abs=True).tolist() == [1, 1, 0, 0, 1, 0]
    # ties: the lowest-index equal scores are dropped first, as argsort(stable) would
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        scores = torch.randint(-3, 4, (40,), generator=generator).float()
        reference = torch.ones(40)
        reference[torch.argsort(scores, stable=True)[: int(0.6 * 40)]] = 0
        assert torch.equal(top_k_mask(scores, 0.4), reference)


def test_reordering_puts_the_sorted_initial_scores_in_ranking_order():
    supernet = cached_supernet("mlp", (64,), 10, seed=5, hidden=[32])
    initial = [layer.scores.detach().clone().reshape(-1) for layer in supernet.layers]
    supernet.load_rankings(supernet.initial_rankings())  # R_g of round 0 = argsort(s0): s = s0
    for layer, s0 in zip(supernet.layers, initial, strict=True):
        assert torch.equal(layer.scores.detach().reshape(-1), s0)
    rng = np.random.default_rng(0)
    rankings = [rng.permutation(n) for n in supernet.layer_sizes]
    supernet.load_rankings(rankings)
    for layer, ranking, s0 in zip(supernet.layers, rankings, initial, strict=True):
        s = layer.scores.detach().reshape(-1)
        assert torch.equal(
            s[torch.from_numpy(ranking)], torch.sort(s0).values
        )  # s[R[j]] = sort(s0)[j]
        assert np.array_equal(ranking_of(s.numpy()), ranking)  # and the ranking reads back


# --- initialisation and the per-process cache ----------------------------------------------------


def test_weight_inits_have_the_documented_values():
    fan_in = 256  # SupermaskLinear(256, 512): 131,072 edges
    for init in ("signed_kaiming_constant", "kaiming_normal", "kaiming_uniform"):
        model = build_supernet("mlp", (256,), 10, seed=0, weight_init=init, hidden=[512])
        layer = supermask_layers(model)[0]
        w, s = layer.weight.numpy().reshape(-1), layer.scores.detach().numpy().reshape(-1)
        if init == "signed_kaiming_constant":  # sign(w0) * sqrt(2 / fan_in)
            assert np.allclose(np.abs(w), math.sqrt(2 / fan_in), rtol=1e-6, atol=0)
            assert abs((w > 0).mean() - 0.5) < 0.01
        elif init == "kaiming_normal":  # N(0, 2 / fan_in)
            assert abs(w.std() / math.sqrt(2 / fan_in) - 1) < 0.01 and abs(w.mean()) < 1e-3
        else:  # U(-sqrt(6 / fan_in), sqrt(6 / fan_in))
            bound = math.sqrt(6 / fan_in)
            assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
            assert abs(w.std() / (bound / math.sqrt(3)) - 1) < 0.01
        # scores: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) whatever the weight init
        assert np.abs(s).max() <= 1 / math.sqrt(fan_in)
        assert abs(s.std() / (1 / math.sqrt(3 * fan_in)) - 1) < 0.01
    conv = supermask_layers(build_supernet("lenet", (1, 12, 12), 10, seed=0))[1]
    assert conv.fan_in == 32 * 3 * 3
    assert np.allclose(np.abs(conv.weight.numpy()), math.sqrt(2 / 288))


def test_same_seed_same_supernet_other_seed_other():
    a = build_supernet("conv2", (1, 8, 8), 10, seed=7)
    b = build_supernet("conv2", (1, 8, 8), 10, seed=7)
    c = build_supernet("conv2", (1, 8, 8), 10, seed=8)
    assert _supernet_digest(a) == _supernet_digest(b) != _supernet_digest(c)


def test_worker_cache_regenerates_the_servers_supernet_bit_for_bit():
    """A fresh process (a Ray worker) rebuilds exactly the server's weights and scores."""
    algorithm = FRL()
    ctx = _ctx(_frl_config())
    clear_supernet_cache()  # earlier tests trained the cached supernet's scores
    server_side = algorithm.supernet(ctx)
    assert algorithm.supernet(ctx) is server_side  # built once per process, then cached
    digest = _supernet_digest(server_side.model)
    clear_supernet_cache()
    rebuilt = algorithm.supernet(ctx)
    assert rebuilt is not server_side and _supernet_digest(rebuilt.model) == digest
    script = (
        "from raysim import config; from raysim.algorithms.frl import FRL;"
        "from raysim.core.algorithm import RunContext; import hashlib;"
        f"cfg = config.load({str(FRL_CONFIG)!r}, {list(SHORT)!r});"
        "s = FRL().supernet(RunContext(cfg, (64,), 10)); d = hashlib.sha256();"
        "[(d.update(l.weight.numpy().tobytes()), d.update(l.scores.detach().numpy().tobytes()))"
        " for l in s.layers]; print(d.hexdigest())"
    )
    other = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip() == digest


def _conv_edges(in_channels: int, widths: list[int], flat: int) -> int:
    """3x3 convolutions, then the 256-256-10 head on `flat` features."""
    channels = [in_channels, *widths]
    return (
        sum(9 * a * b for a, b in zip(channels, channels[1:], strict=False))
        + flat * 256
        + 256**2
        + 2560
    )


@pytest.mark.parametrize(
    ("name", "input_shape", "edges"),
    [
        ("mlp", (64,), 64 * 128 + 128 * 10),
        ("lenet", (1, 12, 12), 9 * 32 + 9 * 32 * 64 + 64 * 4 * 4 * 128 + 128 * 10),
        ("conv2", (3, 8, 8), _conv_edges(3, [64, 64], 64 * 4 * 4)),
        ("conv4", (3, 8, 8), _conv_edges(3, [64, 64, 128, 128], 128 * 2 * 2)),
        ("conv6", (3, 8, 8), _conv_edges(3, [64, 64, 128, 128, 256, 256], 256)),
    ],
)
def test_architectures_have_classic_shapes_without_biases(name, input_shape, edges):
    model = build_supernet(name, input_shape, 10, seed=0)
    assert sum(layer.scores.numel() for layer in supermask_layers(model)) == edges
    assert not list(model.buffers())[0].requires_grad
    assert {n for n, _ in model.named_parameters()} == {
        f"{n}.scores" for n, m in model.named_modules() if m in supermask_layers(model)
    }
    assert model(torch.zeros(2, *input_shape)).shape == (2, 10)
    if name != "conv6":  # classic.py has no conv6; the others match it weight for weight
        from raysim.models import classic

        dense = getattr(classic, name)(input_shape, 10)
        weights = [p.numel() for n, p in dense.named_parameters() if n.endswith("weight")]
        assert [layer.scores.numel() for layer in supermask_layers(model)] == weights


def test_unknown_architecture_init_and_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match=r"'model.name' 'resnet'.*choices: mlp, lenet"):
        build_supernet("resnet", (3, 32, 32), 10, seed=0)
    with pytest.raises(ConfigError, match=r"'algorithm.weight_init' 'xavier'"):
        build_supernet("mlp", (64,), 10, seed=0, weight_init="xavier")
    with pytest.raises(ConfigError, match=r"'model.name' 'conv4' needs image inputs"):
        build_supernet("conv4", (64,), 10, seed=0)
    with pytest.raises(ConfigError, match=r"'model.init'.*'algorithm.weight_init'"):
        build_supernet("mlp", (64,), 10, seed=0, init="kaiming_normal")
    with pytest.raises(ConfigError, match=r"'algorithm.k' must be in \(0, 1\]"):
        FRL(k=0.0)
    with pytest.raises(ConfigError, match=r"'algorithm.lr_decay' must be in \(0, 1\]"):
        FRL(lr_decay=1.5)
    with pytest.raises(ConfigError, match=r"'algorithm.weight_init'"):
        FRL(weight_init="xavier")
    with pytest.raises(ConfigError, match=r"algorithm.kk"):
        config.load(FRL_CONFIG, ["algorithm.kk=0.3"])


# --- bit-packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257, 100_000])
def test_bit_packing_round_trips_permutations_with_exact_byte_counts(n):
    permutation = np.random.default_rng(n).permutation(n)
    packed = rankcodec.pack(permutation, n)
    bits = 0 if n == 1 else math.ceil(math.log2(n))
    assert rankcodec.bits_for(n) == bits
    assert packed.dtype == np.uint8 and packed.nbytes == math.ceil(n * bits / 8)
    assert packed.nbytes == rankcodec.packed_nbytes(n)
    assert np.array_equal(rankcodec.unpack(packed, n, n), permutation)


@pytest.mark.parametrize("n", [2, 5, 63, 64, 65, 640, 2048, 4096, 4097, 70_000])
def test_both_bit_packing_paths_write_the_same_bytes(n, monkeypatch):
    """Small arrays are packed through a matrix of single bits, large ones column by column:
    the same bytes, and each path reads the other's, for whole permutations and partial ones."""
    rng = np.random.default_rng(n)
    for values in (rng.permutation(n), rng.integers(0, n, size=min(n, 4096) - 1)):
        monkeypatch.setattr(rankcodec, "SMALL_ENTRIES", 1 << 30)
        by_bits = rankcodec.pack(values, n)
        monkeypatch.setattr(rankcodec, "SMALL_ENTRIES", 0)
        by_columns = rankcodec.pack(values, n)
        assert by_bits.tobytes() == by_columns.tobytes()
        assert np.array_equal(rankcodec.unpack(by_bits, n, len(values)), values)
        monkeypatch.setattr(rankcodec, "SMALL_ENTRIES", 1 << 30)
        assert np.array_equal(rankcodec.unpack(by_columns, n, len(values)), values)


def test_bit_packing_layout_errors_and_the_multi_layer_formula():
    # 2 bits each, least significant bit first: 1 -> 10, 2 -> 01, 3 -> 11 => 0b00111001
    assert rankcodec.pack(np.array([1, 2, 3]), 4).tolist() == [0b00111001]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        rankcodec.pack(np.array([4]), 4)
    with pytest.raises(ValueError, match="bytes"):
        rankcodec.unpack(np.zeros(3, dtype=np.uint8), 256, 4)
    sizes = [64 * 128, 128 * 10, 7, 1, 300_001]
    messages = [rankcodec.pack(np.random.default_rng(0).permutation(n), n) for n in sizes]
    assert sum(m.nbytes for m in messages) == sum(
        math.ceil(n * (math.ceil(math.log2(n)) if n > 1 else 0) / 8) for n in sizes
    )


# --- the vote ------------------------------------------------------------------------------------


def test_vote_on_a_hand_computed_example():
    """3 clients, one layer of 6 edges (a 2 -> 3 supermask MLP), through the plug-in's code."""
    client_rankings = [
        [0, 1, 2, 3, 4, 5],  # R_1
        [1, 0, 3, 2, 5, 4],  # R_2
        [4, 5, 0, 1, 2, 3],  # R_3
    ]
    # V_u = argsort(R_u): the position of each edge in R_u
    expected_positions = [
        [0, 1, 2, 3, 4, 5],  # V_1
        [1, 0, 3, 2, 5, 4],  # V_2
        [2, 3, 4, 5, 0, 1],  # V_3: edge 4 first, then 5, 0, 1, 2, 3
    ]
    expected_sum = [3, 4, 9, 10, 9, 10]  # A = V_1 + V_2 + V_3
    expected_ranking = [0, 1, 2, 4, 3, 5]  # argsort(A), ties (9, 9), (10, 10) in edge order
    positions = [positions_of(np.array(r)) for r in client_rankings]
    assert [p.tolist() for p in positions] == expected_positions
    assert [p.tolist() for p in positions] == [np.argsort(r).tolist() for r in client_rankings]
    assert vote([sum(positions)])[0].tolist() == expected_ranking
    # The same through FRL: packed messages -> decode -> exact int64 sum -> server update.
    cfg = config.load(FRL_CONFIG, ["model.hidden=[]"])
    ctx = _ctx(cfg, input_shape=(2,), num_classes=3)
    algorithm = FRL()
    assert algorithm.layer_sizes(ctx) == [6]
    state = algorithm.init_server(ctx)
    messages = [[rankcodec.pack(np.array(p), 6)] for p in expected_positions]
    assert [m[0].nbytes for m in messages] == [3, 3, 3]  # 6 entries x 3 bits = 18 bits
    codec, layout = wire_format(algorithm, ctx)
    decoded = [codec.decode(m, layout) for m in messages]
    aggregate = total(decoded)
    assert aggregate.dtype == np.int64 and aggregate.tolist() == expected_sum
    new_state, diagnostics = algorithm.server_update(state, aggregate, ctx)
    assert diagnostics == {}
    assert new_state.round == 1 and list(new_state.arrays) == ["ranking.0"]
    assert new_state.arrays["ranking.0"].tolist() == expected_ranking
    payload = algorithm.server_payload(new_state)
    assert rankcodec.unpack(payload["rankings"][0], 6, 6).tolist() == expected_ranking
    assert payload["round"].tolist() == [1]


def test_client_update_sends_packed_positions_and_an_empty_client_votes_for_r_g():
    cfg = _frl_config()
    ctx = _ctx(cfg)
    algorithm = FRL()
    state = algorithm.init_server(ctx)
    payload = algorithm.server_payload(state)
    empty = algorithm.client_update(
        payload, torch.zeros(0, 64), torch.zeros(0, dtype=torch.long), 3, torch.Generator(), ctx
    )
    assert empty.num_samples == 0 and math.isnan(empty.metrics["loss"])
    global_positions = np.concatenate([positions_of(r) for r in algorithm.rankings(state)])
    codec, layout = wire_format(algorithm, ctx)
    assert np.array_equal(
        codec.decode(codec.encode(empty.vector, layout), layout), global_positions
    )
    x, y = torch.randn(24, 64), torch.arange(24) % 10
    update = algorithm.client_update(payload, x, y, 3, torch.Generator().manual_seed(1), ctx)
    message = codec.encode(update.vector, layout)
    assert [m.nbytes for m in message] == [rankcodec.packed_nbytes(n) for n in LAYER_SIZES]
    positions = codec.decode(message, layout)
    for layer_positions in np.split(positions, [LAYER_SIZES[0]]):
        assert np.array_equal(np.sort(layer_positions), np.arange(len(layer_positions)))
    assert not np.array_equal(positions, global_positions)  # training moved the ranking
    assert update.metrics["loss"] > 0
    # The cached supernet's scores are now trained; a new run still starts from the seed's.
    fresh = build_supernet("mlp", (64,), 10, model_init_seed(cfg.run.seed), hidden=[128])
    for ranking, layer in zip(
        FRL().init_server(ctx).arrays.values(), supermask_layers(fresh), strict=True
    ):
        assert np.array_equal(ranking, ranking_of(layer.scores.detach().numpy()))


# --- whole runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_frl_run(tmp_path_factory):
    return run(_frl_config(), tmp_path_factory.mktemp("frl"), progress=False, tensorboard=False)


def test_frl_on_digits_learns_well_above_chance(short_frl_run):
    final = short_frl_run.summary["final"]
    assert final["accuracy"] >= 0.8  # chance is 0.1; measured 0.91 after 20 rounds
    assert set(short_frl_run.state.arrays) == {"ranking.0", "ranking.1"}
    for ranking, n in zip(FRL.rankings(short_frl_run.state), LAYER_SIZES, strict=True):
        assert ranking.dtype == np.int64 and np.array_equal(np.sort(ranking), np.arange(n))


def test_frl_bytes_in_a_real_run_are_the_bit_packed_formula(short_frl_run):
    """Up: sum_l ceil(n_l ceil(log2 n_l) / 8) per client; down: the same plus the 8-byte round."""
    per_client = sum(math.ceil(n * math.ceil(math.log2(n)) / 8) for n in LAYER_SIZES)
    assert per_client == 8192 * 13 // 8 + 1280 * 11 // 8 == 15_072
    records = [
        json.loads(line)
        for line in (short_frl_run.out_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(records) == 20
    for record in records:
        assert record["bytes_up"] == 10 * per_client
        assert record["bytes_down"] == 10 * (per_client + 8)
    # FedAvg sends 4 bytes per parameter (weights and biases) of the same MLP each way.
    fedavg_params = sum(LAYER_SIZES) + 128 + 10
    assert per_client < 4 * fedavg_params  # 15,072 vs 38,440 bytes


@pytest.mark.ray
def test_frl_rankings_identical_on_local_and_ray_with_any_packing(ray_session, tmp_path):
    overrides = ("run.rounds=3",)
    local = run(_frl_config(*overrides), tmp_path / "local", progress=False, tensorboard=False)
    for per_task in (1, 3):
        result = run(
            _frl_config(*overrides, "runtime.backend=ray", f"clients.per_task={per_task}"),
            tmp_path / f"ray{per_task}",
            progress=False,
            tensorboard=False,
        )
        assert result.summary["backend"] == "ray"
        assert result.state.round == local.state.round == 3
        for name, value in local.state.arrays.items():
            assert result.state.arrays[name].tobytes() == value.tobytes(), name
        assert result.summary["final"] == local.summary["final"]
        assert result.summary["bytes_up"] == local.summary["bytes_up"]


# --- the fast paths are the plain definitions, exactly -------------------------------------------


def _awkward_floats(rng: np.random.Generator, n: int, kind: int) -> np.ndarray:
    if kind == 0:  # many ties
        return rng.integers(-3, 4, n).astype(np.float32)
    if kind == 1:  # signed zeros, infinities, NaN with several payloads and signs
        nans = np.array([0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFC00000], np.uint32)
        special = np.concatenate(
            [np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45], np.float32), nans.view("<f4")]
        )
        return rng.choice(special, n)
    if kind == 2:  # subnormals
        return (rng.standard_normal(n) * 1e-40).astype(np.float32)
    return rng.standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("n", [1, 7, 1000, 40_000])  # radix sort from 32,768 entries on
def test_ranking_of_is_numpys_stable_argsort_for_any_floats_and_integers(n):
    rng = np.random.default_rng(n)
    for kind in range(4):
        scores = _awkward_floats(rng, n, kind)
        expected = np.argsort(scores, kind="stable")
        assert np.array_equal(ranking_of(scores), expected), kind
        assert np.array_equal(ranking_of(torch.from_numpy(scores)), expected), kind
    for sums in (rng.integers(0, 10 * n, n), rng.integers(-(2**62), 2**62, n)):  # the vote
        assert np.array_equal(ranking_of(sums), np.argsort(sums, kind="stable"))
    assert ranking_of(scores).dtype == np.int64


def test_the_mask_threshold_window_never_changes_the_mask():
    """The layer's threshold hint (supermask.ThresholdHint) only speeds the selection up: with
    any hint, good or bad, the threshold is kthvalue's and the mask the stable-sort rule's."""
    from raysim.models.supermask import ThresholdHint, kth_smallest

    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.choice([2, 50, 3000]))
        scores = torch.from_numpy(_awkward_floats(rng, n, trial % 4))
        hint = ThresholdHint()
        for step in range(3):
            kth = int(rng.integers(1, n + 1))
            value, at_most = kth_smallest(scores, kth, hint)
            expected = torch.kthvalue(scores, kth).values
            assert torch.equal(value, expected) or (value.isnan() and expected.isnan())
            assert at_most == int((scores <= expected).sum())
            k = float(rng.choice([0.1, 0.5, 0.9]))
            reference = torch.ones(n)
            reference[torch.argsort(scores, stable=True)[: int((1 - k) * n)]] = 0
            if not scores.isnan().any():  # argsort and kthvalue agree on NaN's place
                assert torch.equal(top_k_mask(scores, k, hint=hint), reference)
            assert torch.equal(top_k_mask(scores, k, hint=hint), top_k_mask(scores, k))
            if step == 1:  # a hint from somewhere else entirely
                hint.value, hint.width = float(rng.standard_normal()), float(rng.random())
            scores = scores + torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * 1e-3


def _bit_by_bit_pack(values: np.ndarray, n: int) -> np.ndarray:
    bits = rankcodec.bits_for(n)
    stream = np.zeros(len(values) * bits, dtype=np.uint8)
    for entry, value in enumerate(values):
        for bit in range(bits):
            stream[entry * bits + bit] = (int(value) >> bit) & 1
    return np.packbits(stream, bitorder="little")


@pytest.mark.parametrize("n", [2, 5, 64, 65, 1000, 2**21 + 3, 2**40])
def test_bit_packing_is_the_documented_bit_stream(n):
    """Entry e at bits [e*b, (e+1)*b), LSB first, bit p in byte p // 8 at bit p % 8."""
    values = np.random.default_rng(n).integers(0, n, 300)
    packed = rankcodec.pack(values, n)
    assert np.array_equal(packed, _bit_by_bit_pack(values, n))
    assert np.array_equal(rankcodec.unpack(packed, n, len(values)), values)
    # Over a chunk boundary (CHUNK_ENTRIES entries a chunk), against the plain numpy form.
    count = rankcodec.CHUNK_ENTRIES + 77
    big = np.random.default_rng(1).integers(0, n, count)
    bits = rankcodec.bits_for(n)
    matrix = np.unpackbits(
        big.astype("<u8").view(np.uint8).reshape(-1, 8), axis=1, bitorder="little"
    )
    expected = np.packbits(matrix[:, :bits].reshape(-1), bitorder="little")
    assert np.array_equal(rankcodec.pack(big, n), expected)
    assert np.array_equal(rankcodec.unpack(expected, n, count), big)


def test_a_clients_update_depends_on_nothing_the_worker_ran_before():
    """The round's unpacked rankings are cached per worker and the optimizer is reused, reset:
    a client's update is the same first, after other clients, after another round's payload
    and with the caches emptied (fresh momentum every round, as the reference code has)."""
    from raysim.algorithms import frl, frl_ranking

    cfg = _frl_config()
    ctx = _ctx(cfg)
    algorithm = FRL()
    state = algorithm.init_server(ctx)
    payload = algorithm.server_payload(state)
    x, y = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)), torch.arange(40) % 10

    def update(payload, client_id, rows=slice(None)):
        generator = torch.Generator().manual_seed(client_id)
        result = algorithm.client_update(payload, x[rows], y[rows], client_id, generator, ctx)
        return result.vector

    first = update(payload, 1)
    update(payload, 2, slice(0, 13))
    assert np.array_equal(update(payload, 1), first)
    rng = np.random.default_rng(0)
    other = algorithm.server_payload(frl.FRL._state(5, [rng.permutation(n) for n in LAYER_SIZES]))
    assert not np.array_equal(update(other, 1), first)  # a new payload is not the cached one
    assert np.array_equal(update(payload, 1), first)
    frl_ranking._ROUND_RANKINGS.clear()
    assert np.array_equal(update(payload, 1), first)


def test_lr_schedule_option_cosine_epochs_trains_epoch_two_at_half_the_rate(monkeypatch):
    from raysim.core import client_step

    with pytest.raises(ConfigError, match=r"'algorithm.lr_schedule' must be one of"):
        FRL(lr_schedule="warmup")
    assert config.load(FRL_CONFIG, ["algorithm.lr_schedule=cosine_epochs"])
    rates: list[float] = []
    monkeypatch.setattr(client_step, "set_lr", lambda optimizer, rate: rates.append(rate))
    cfg = _frl_config()  # E = 2, batch 8: 24 samples are 3 steps an epoch
    ctx = _ctx(cfg)
    x, y = torch.randn(24, 64), torch.arange(24) % 10
    for schedule, expected in [
        ("cosine_epochs", [0.8] * 3 + [0.4] * 3),
        ("cosine_steps", [0.8 * 0.5 * (1 + math.cos(math.pi * s / 6)) for s in range(6)]),
        ("constant", [0.8] * 6),
    ]:
        algorithm = FRL(lr_schedule=schedule)
        rates.clear()
        payload = algorithm.server_payload(algorithm.init_server(ctx))
        algorithm.client_update(payload, x, y, 0, torch.Generator().manual_seed(0), ctx)
        assert rates == pytest.approx(expected, rel=1e-12, abs=1e-15), schedule
    assert rates[0] == cfg.clients.lr  # round 0: no decay yet
