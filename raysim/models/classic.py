"""Standard (dense-weight) models used by FedAvg and the other weight-training baselines.

Every factory has the signature `factory(input_shape, num_classes, *, options)`; the keyword-only
options are what a config's `model:` section may set. The Conv2/4/8 family follows the
edge-popup / FRL lineage (Ramanujan et al. 2020; Zhou et al. 2019): 3x3 convolutions in pairs,
each pair followed by 2x2 max-pooling, then 256-256-classes fully connected. LeNet is the
PyTorch MNIST network the FRL code calls LeNet (two 3x3 convolutions, 128 hidden units).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

WEIGHT_INITS = ("default", "signed_kaiming_constant", "kaiming_normal", "kaiming_uniform")


def _initialise(model: nn.Module, init: str) -> nn.Module:
    """Re-initialise conv/linear weights (for FRL's init study; 'default' keeps PyTorch's).

    Uses torch's global RNG, which `build_model` seeds from the run seed.
    """
    if init not in WEIGHT_INITS:
        raise ValueError(f"'model.init' must be one of {', '.join(WEIGHT_INITS)}, got {init!r}")
    if init == "default":
        return model
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            weight = module.weight
            if init == "kaiming_uniform":
                nn.init.kaiming_uniform_(weight, nonlinearity="relu")
            else:
                nn.init.kaiming_normal_(weight, nonlinearity="relu")
                if init == "signed_kaiming_constant":
                    fan_in = nn.init._calculate_correct_fan(weight, "fan_in")
                    with torch.no_grad():
                        weight.copy_(weight.sign() * (2.0 / fan_in) ** 0.5)
    return model


def _flat_size(features: nn.Module, input_shape: Sequence[int]) -> int:
    with torch.no_grad():
        return int(features(torch.zeros(1, *input_shape)).numel())


def _image_shape(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"model '{model}' needs image inputs (channels, height, width), got shape "
            f"{tuple(input_shape)}; use model 'mlp' for flat features"
        )
    return tuple(int(s) for s in input_shape)  # type: ignore[return-value]


def layer_widths(hidden: Sequence[int]) -> list[int]:
    """`model.hidden` as a list of layer widths, each a whole number >= 1 (torch would accept
    0 and fail on negatives with a traceback)."""
    if isinstance(hidden, int | str) or not isinstance(hidden, Sequence):
        raise ValueError(f"option 'hidden' must be a list of layer widths, got {hidden!r}")
    for size in hidden:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"option 'hidden' must hold whole numbers >= 1, got {list(hidden)}")
    return [int(size) for size in hidden]


def mlp(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden: Sequence[int] = (128,),
    init: str = "default",
) -> nn.Module:
    """Fully connected ReLU network on flattened inputs (e.g. digits: 64-128-10)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = 1
    for size in input_shape:
        width *= int(size)
    for size in layer_widths(hidden):
        layers += [nn.Linear(width, int(size)), nn.ReLU()]
        width = int(size)
    layers.append(nn.Linear(width, num_classes))
    return _initialise(nn.Sequential(*layers), init)


def lenet(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    init: str = "default",
    padding: int = 0,
    bias: bool = True,
) -> nn.Module:
    """Two 3x3 convs (32, 64), one 2x2 max-pool, fc 128, fc classes.

    The FRL reference code's LeNet pads its convs (`padding: 1`: fc 12544-128-10 on 28x28)
    and has no biases (`bias: false`); the defaults keep raysim's unpadded, biased LeNet
    (fc 9216-128-10), whose results the README reports."""
    if padding not in (0, 1):
        raise ValueError(f"'model.padding' must be 0 or 1, got {padding!r}")
    channels, _, _ = _image_shape(input_shape, "lenet")
    features = nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=padding, bias=bias),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=padding, bias=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    model = nn.Sequential(
        features,
        nn.Linear(_flat_size(features, input_shape), 128, bias=bias),
        nn.ReLU(),
        nn.Linear(128, num_classes, bias=bias),
    )
    return _initialise(model, init)


def _conv_net(
    input_shape: Sequence[int], num_classes: int, widths: Sequence[int], name: str
) -> nn.Module:
    channels, _, _ = _image_shape(input_shape, name)
    layers: list[nn.Module] = []
    for pair_index in range(0, len(widths), 2):
        for width in widths[pair_index : pair_index + 2]:
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
        layers.append(nn.MaxPool2d(2))
    features = nn.Sequential(*layers, nn.Flatten())
    return nn.Sequential(
        features,
        nn.Linear(_flat_size(features, input_shape), 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, num_classes),
    )


def conv2(input_shape: Sequence[int], num_classes: int, *, init: str = "default") -> nn.Module:
    return _initialise(_conv_net(input_shape, num_classes, (64, 64), "conv2"), init)


def conv4(input_shape: Sequence[int], num_classes: int, *, init: str = "default") -> nn.Module:
    return _initialise(_conv_net(input_shape, num_classes, (64, 64, 128, 128), "conv4"), init)


def conv6(input_shape: Sequence[int], num_classes: int, *, init: str = "default") -> nn.Module:
    return _initialise(
        _conv_net(input_shape, num_classes, (64, 64, 128, 128, 256, 256), "conv6"), init
    )


def conv8(input_shape: Sequence[int], num_classes: int, *, init: str = "default") -> nn.Module:
    return _initialise(
        _conv_net(input_shape, num_classes, (64, 64, 128, 128, 256, 256, 512, 512), "conv8"), init
    )
