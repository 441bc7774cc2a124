"""The validation split (`data.validation_fraction`): rows held out of the training source
before the client split. For every dataset (the embedded ones through `load_dataset`, the
file-based ones from the valid folders tests/test_hostile_input.py builds) and every
partitioner: validation never overlaps test or training, no client trains on it, and runs
report it apart from the test split."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_hostile_input import FORMATS, dataset_folders  # noqa: F401 - a fixture

from raysim import config, registry
from raysim.assembly import plan_run, run
from raysim.data.datasets import carve_validation, load_dataset, validation_rows
from raysim.data.partition import split_dataset

EMBEDDED = {
    "digits": {},
    "synthetic_classification": {"num_samples": 600, "num_test": 100},
    "synthetic_multilabel": {"num_samples": 600, "num_test": 100},
    "synthetic_xml": {"num_labels": 64, "num_train": 600, "num_test": 100, "num_features": 1000},
}


def _rows_as_bytes(array: np.ndarray) -> set[bytes]:
    array = np.ascontiguousarray(array)
    return {row.tobytes() for row in array.reshape(len(array), -1)}


def _check_carved(source, carved, fraction: float, seed: int) -> None:
    """The held-out rows are exactly `validation_rows` of the source's training rows; the
    training split keeps the rest in order; the test split is untouched."""
    rows = validation_rows(len(source.train_y), fraction, seed)
    keep = np.setdiff1d(np.arange(len(source.train_y)), rows)
    assert len(rows) >= 1 and len(keep) >= 1
    assert np.array_equal(carved.val_x, source.train_x[rows])
    assert np.array_equal(carved.train_x, source.train_x[keep])
    assert np.array_equal(carved.train_y, source.train_y[keep])
    assert np.array_equal(carved.test_x, source.test_x)
    assert np.array_equal(carved.test_y, source.test_y)
    expected_y = source.train_y if source.train_label_sets is None else source.train_label_sets
    assert np.array_equal(carved.val_y, expected_y[rows])
    # By content, too: no validation sample is a test sample unless the source itself repeats
    # that sample between its training and test splits.
    shared_in_source = _rows_as_bytes(source.train_x) & _rows_as_bytes(source.test_x)
    assert not (_rows_as_bytes(carved.val_x) & _rows_as_bytes(source.test_x)) - shared_in_source


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_datasets_hold_validation_out_of_training_and_test(name):
    overrides = [f"data.name={name}", *(f"data.{k}={v}" for k, v in EMBEDDED[name].items())]
    base = config.load("configs/fedavg_digits.yaml", overrides)
    source = load_dataset(base)
    carved = load_dataset(base.replace(data__validation_fraction=0.2))
    from raysim.seeds import VALIDATION, purpose_seed

    _check_carved(source, carved, 0.2, purpose_seed(base.run.seed, VALIDATION))
    if np.issubdtype(source.train_x.dtype, np.floating):  # continuous: no repeated samples
        assert not _rows_as_bytes(carved.val_x) & _rows_as_bytes(carved.train_x)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_file_datasets_hold_validation_out_of_training_and_test(dataset_folders, fmt):  # noqa: F811
    _, _, load = dataset_folders(fmt)
    source = load()
    if not hasattr(source, "train_x"):  # a reader of one file, not a whole dataset
        pytest.skip(f"{fmt.name} loads a part of a dataset")
    if len(source.train_y) < 2:
        pytest.skip("a one-row training split cannot give up a validation row")
    carved = carve_validation(source, 0.3, seed=7)
    _check_carved(source, carved, 0.3, 7)


@pytest.mark.parametrize("name", ["fashion_mnist", "mnist_5k", "yeast"])
def test_offline_datasets_hold_validation_out_of_training_and_test(tmp_path, name):
    """raysim.data.offline's datasets, from tiny files in their formats
    (tests/test_offline_datasets.py writes them)."""
    from test_offline_datasets import write_fashion_mnist, write_mnist_5k, write_yeast

    options = {}
    if name == "fashion_mnist":
        write_fashion_mnist(tmp_path)
    elif name == "mnist_5k":
        write_mnist_5k(tmp_path / "mnist_5k.csv.gz")
    else:
        write_yeast(tmp_path / "yeast.csv.gz")
        options = {"num_test": 4}
    source = registry.datasets.build(name, str(tmp_path), 0, **options)
    carved = carve_validation(source, 0.3, seed=7)
    _check_carved(source, carved, 0.3, 7)


def test_every_registered_dataset_is_covered():
    file_names = {"mnist", "cifar10", "cifar100", "femnist", "arff", "coco"}
    file_names |= {"extreme_classification", "xc_multilabel"}
    file_names |= {"fashion_mnist", "mnist_5k", "yeast"}  # the offline test above
    assert set(registry.datasets.names()) <= set(EMBEDDED) | file_names


@pytest.mark.parametrize("partitioner", registry.partitioners.names())
def test_no_partitioner_puts_a_validation_row_on_a_client(partitioner):
    multilabel = partitioner in ("kmodes", "random")
    data = "synthetic_multilabel" if multilabel else "digits"
    options = {"natural": {}, "shards": {"shards_per_client": 2}}.get(partitioner, {})
    name = data if partitioner != "natural" else "synthetic_classification"
    base = config.load(
        "configs/flag_flag.yaml" if multilabel else "configs/fedavg_digits.yaml",
        [f"data.name={name}", "data.validation_fraction=0.2", "partition.num_clients=10",
         "clients.per_round=5"],
    )  # fmt: skip
    dataset = load_dataset(base)
    if partitioner == "natural":  # writers: give the synthetic rows natural groups
        groups = np.arange(len(dataset.train_y)) % 10
        dataset = dataclasses.replace(dataset, train_groups=groups.astype(np.int64))
    result = split_dataset(dataset, partitioner, 10, seed=3, options=options)
    indices = result.train.indices
    assert len(indices) and indices.min() >= 0 and indices.max() < len(dataset.train_y)
    assert len(np.unique(indices)) == len(indices)  # each training row on one client at most
    if result.validation is not None:  # per-client rows of the test split
        assert result.validation.indices.max() < len(dataset.test_y)


def test_a_run_reports_validation_and_test_apart(tmp_path):
    cfg = config.load(
        "configs/flag_flag.yaml",
        ["runtime.backend=local", "run.rounds=2", "data.validation_fraction=0.1"],
    )
    result = run(cfg, tmp_path / "run", progress=False, tensorboard=False)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert set(record["val"]) == {"map", "gmap", "gmap_worst", "amap", "wmap"}
    assert record["val"] == result.summary["final_val"]
    assert record["eval"]["gmap"] != record["val"]["gmap"]
    # the clients' validation rows are rows of the validation split, not of the test split
    ctx = plan_run(cfg, load_dataset(cfg)).ctx
    dataset = load_dataset(cfg)
    assert ctx.client_validation_of_val.indices.max() < len(dataset.val_y)
    assert ctx.client_validation.indices.max() < len(dataset.test_y)
    # without the option nothing changes: no validation split, the same test numbers as before
    plain = run(
        cfg.replace(data__validation_fraction=0.0),
        tmp_path / "plain",
        progress=False,
        tensorboard=False,
    )
    assert plain.summary["final_val"] is None


def test_a_run_evaluates_exactly_the_rounds_eval_at_names(tmp_path):
    """A table that names round 25 reads round 25, not the nearest evaluated round (the FRL
    study's '@25' column was the round-20 evaluation)."""
    cfg = config.load(
        "configs/fedavg_digits.yaml",
        ["runtime.backend=local", "run.rounds=7", "run.eval_every=4", "run.eval_at=[3, 5]"],
    )
    run(cfg, tmp_path / "run", progress=False, tensorboard=False)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["round"] for r in records if "eval" in r] == [3, 4, 5, 7]


@pytest.mark.parametrize("partitioner", ["kmodes", "random", "iid", "dirichlet"])
def test_the_one_call_placement_of_the_validation_rows_is_the_second_calls(partitioner):
    """The built-in multi-label partitioners place the validation split's rows in the same
    call as the test rows (PartitionResult.validation_of_val); a partitioner that does not is
    called a second time with the validation rows as its test set. Both give the same clients
    for every row, so the shortcut cannot change a result."""
    cfg = config.from_dict(
        {
            "data": {"name": "synthetic_multilabel", "validation_fraction": 0.2,
                     "num_samples": 600, "num_test": 100},
            "partition": {"name": partitioner, "num_clients": 6},
            "clients": {"per_round": 6},
            "algorithm": {"name": "flag"},
            "model": {"name": "mlp", "hidden": [8]},
        }
    )  # fmt: skip
    dataset = load_dataset(cfg)
    once = split_dataset(dataset, partitioner, 6, 1234)
    as_test = dataclasses.replace(dataset, test_x=dataset.val_x, test_y=dataset.val_y)
    second = split_dataset(as_test, partitioner, 6, 1234).validation
    assert once.validation_of_val is not None
    assert np.array_equal(once.validation_of_val.indices, second.indices)
    assert np.array_equal(once.validation_of_val.offsets, second.offsets)
    # and the run context carries that placement
    ctx = plan_run(cfg, dataset).ctx
    assert ctx.client_validation_of_val.num_clients == 6
