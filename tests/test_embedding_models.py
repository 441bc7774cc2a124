"""FedAwS embedding networks: the XML bag-of-words network and the CIFAR ResNets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from raysim import registry
from raysim.errors import ConfigError
from raysim.models import vector
from raysim.models.embedding import resnet8, resnet32, resnet56, xml_embedding_bag

NUM_FEATURES = 50
PAD = NUM_FEATURES


def small_bag(**options) -> nn.Module:
    torch.manual_seed(0)
    options = {"embedding_dim": 8, "bag_dim": 16, "hidden": [32, 32], **options}
    return registry.models.build("xml_embedding_bag", (6,), 1000, NUM_FEATURES, **options)


def test_xml_bag_shapes_and_unit_norm():
    model = small_bag()
    assert model.embedding_dim == 8
    x = torch.tensor([[1, 2, 3, PAD, PAD, PAD], [4, 4, 49, 0, 7, 8]], dtype=torch.int32)
    out = model(x)
    assert out.shape == (2, 8)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(2))
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(16, 32), (32, 32), (32, 8)]
    assert model.bag.weight.shape == (NUM_FEATURES + 1, 16) and model.bag.mode == "mean"


def test_xml_bag_default_is_the_paper_network():
    model = xml_embedding_bag((4,), 10, 100)
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [
        (512, 1024),
        (1024, 1024),
        (1024, 512),
    ]
    assert model.embedding_dim == 512 and model.bag.embedding_dim == 512


def test_padding_ids_do_not_affect_the_bag_mean():
    model = small_bag()
    with torch.no_grad():
        padded = model(torch.tensor([[3, 9, PAD, PAD, PAD, PAD]]))
        short = model(torch.tensor([[9, 3]]))
        wide = model(torch.tensor([[PAD, 3, PAD, 9, PAD, PAD, PAD, PAD]]))
        pooled = model.bag.weight[[3, 9]].mean(dim=0)
        torch.testing.assert_close(model.bag(torch.tensor([[3, PAD, 9]]))[0], pooled)
    torch.testing.assert_close(padded, short)
    torch.testing.assert_close(padded, wide)
    assert torch.count_nonzero(model.bag.weight[PAD]) == 0


def test_touched_rows_and_the_small_table_path_match_the_full_model():
    model = small_bag()
    x = torch.tensor([[7, 3, 7, PAD], [40, 3, PAD, PAD]], dtype=torch.int32)
    rows = model.touched_feature_rows(x)
    np.testing.assert_array_equal(rows, [3, 7, 40])
    assert rows.dtype == np.int64
    local = model.remap(x, rows)
    np.testing.assert_array_equal(local.numpy(), [[1, 0, 1, 3], [2, 0, 3, 3]])

    table = model.bag.weight.detach()[torch.from_numpy(rows)].clone().requires_grad_(True)
    small = model.forward_rows(local, table)
    target = torch.randn(2, 8)
    (small * target).sum().backward()
    small_grad = table.grad.clone()
    model.zero_grad()
    full = model(x)
    (full * target).sum().backward()
    torch.testing.assert_close(small, full)
    torch.testing.assert_close(small_grad, model.bag.weight.grad[torch.from_numpy(rows)])
    untouched = np.setdiff1d(np.arange(NUM_FEATURES + 1), rows)
    assert torch.count_nonzero(model.bag.weight.grad[torch.from_numpy(untouched)]) == 0
    with pytest.raises(ValueError, match="not in `rows`"):
        model.remap(torch.tensor([[5, 3]]), rows)


def test_touched_rows_sorts_once_what_touched_feature_rows_and_remap_give():
    model = small_bag()
    generator = np.random.default_rng(0)
    for shape, padding in [((5, 9), 0.3), ((3, 4), 0.0), ((4, 6), 1.0), ((0, 6), 0.0)]:
        x = generator.integers(0, NUM_FEATURES, size=shape)
        x[generator.random(shape) < padding] = PAD
        x = torch.from_numpy(x.astype(np.int32))
        rows, local = model.touched_rows(x)
        want_rows = model.touched_feature_rows(x)
        np.testing.assert_array_equal(rows, want_rows)
        assert rows.dtype == np.int64 and local.dtype == torch.int64
        assert torch.equal(local, model.remap(x, want_rows))
    for bad in (-1, PAD + 1):
        with pytest.raises(ValueError, match="feature ids outside"):
            model.touched_rows(torch.tensor([[3, bad]]))


def test_sparse_gradients_option():
    model = small_bag(sparse_gradients=True)
    model(torch.tensor([[1, 2, PAD]])).sum().backward()
    assert model.bag.weight.grad.is_sparse


def test_xml_bag_rejects_dense_inputs_with_a_clear_message():
    with pytest.raises(ValueError, match="needs sparse bag-of-words inputs"):
        xml_embedding_bag((64,), 10)
    with pytest.raises(ValueError, match=r"'model\.embedding_dim' must be a positive integer"):
        xml_embedding_bag((4,), 10, 100, embedding_dim=0)


def count_convs(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Conv2d) for m in model.modules())


@pytest.mark.parametrize(
    ("factory", "convs", "parameters"),
    # depth = convs + the final linear layer; option-A shortcuts add no convolutions. The
    # parameter counts are He et al.'s 0.46M (ResNet-32) and 0.85M (ResNet-56).
    [(resnet8, 7, 78_800), (resnet32, 31, 467_664), (resnet56, 55, 856_528)],
)
def test_resnet_depths(factory, convs, parameters):
    torch.manual_seed(0)
    model = factory((3, 32, 32), 10)
    assert count_convs(model) == convs
    assert all(m.kernel_size == (3, 3) for m in model.modules() if isinstance(m, nn.Conv2d))
    assert sum(p.numel() for p in model.parameters()) == parameters
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 64) and model.embedding_dim == 64
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3))


def test_resnet_classifier_mode_gives_logits():
    torch.manual_seed(0)
    model = resnet8((3, 32, 32), 10, embedding_dim=None)
    assert model.embedding_dim is None
    model.eval()
    with torch.no_grad():
        logits = model(torch.randn(4, 3, 32, 32))
    assert logits.shape == (4, 10)
    assert not torch.allclose(logits.norm(dim=1), torch.ones(4))
    small = resnet8((1, 28, 28), 7, embedding_dim=16)  # any image size and channel count
    assert small(torch.randn(2, 1, 28, 28)).shape == (2, 16)


def test_resnet_trains_in_the_flat_vector_form():
    """BatchNorm running statistics travel in the flat vector (vector.get/set_vector)."""
    torch.manual_seed(0)
    model = resnet8((3, 8, 8), 4, embedding_dim=None)
    before = vector.get_vector(model)
    assert len(before) == vector.vector_size(model) > sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3, 8, 8), torch.arange(8) % 4
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]  # it learns
    after = vector.get_vector(model)
    vector.set_vector(model, before)
    np.testing.assert_array_equal(vector.get_vector(model), before)
    assert not np.array_equal(before, after)


def test_resnet_input_checks():
    with pytest.raises(ValueError, match=r"needs image inputs \(channels, height, width\)"):
        resnet32((64,), 10)
    with pytest.raises(ValueError, match="gives sparse feature ids"):
        resnet32((64,), 10, 1000)


def test_registered_with_options():
    for name in ("xml_embedding_bag", "resnet8", "resnet32", "resnet56"):
        assert name in registry.models
    assert registry.models.option_names("resnet32") == ["embedding_dim", "norm"]
    assert registry.models.check_options("resnet32", {"embedding_dim": None}, "model") == {
        "embedding_dim": None
    }
    assert registry.models.option_names("xml_embedding_bag") == [
        "embedding_dim",
        "bag_dim",
        "hidden",
        "sparse_gradients",
    ]
    with pytest.raises(ConfigError, match=r"'model\.hidden' expects"):
        registry.models.check_options("xml_embedding_bag", {"hidden": ["a"]}, "model")


def test_resnet_group_norm_has_no_batch_statistics_and_unit_output():
    import torch

    from raysim.models.embedding import resnet8

    model = resnet8((3, 32, 32), 10, norm="group")
    assert not any("running_mean" in name for name, _ in model.named_buffers())
    out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 64)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3))
    # A one-sample batch works (no batch statistics), unlike BatchNorm's need for several.
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 64)
