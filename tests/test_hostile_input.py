"""Property-based tests: hostile input gives a raysim error, never a stray exception.

Config loader: random YAML documents, random text and random `--set` overrides may only raise
ConfigError (a RaysimError). Data parsers: random bytes, truncated or bit-flipped files and
well-formed files with wrong contents may only raise DataError. Any other exception (KeyError,
TypeError, OverflowError, zlib.error, RecursionError, ...) would reach the user as a traceback.

A data format joins the parser tests by adding one `FileFormat` to FORMATS: a function that
writes a complete, valid dataset under a folder and returns the file to corrupt plus a loader.
Examples are bounded (hypothesis settings below) so the file runs in well under a minute.
"""

from __future__ import annotations

import gzip
import importlib
import json
import math
import pickle
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raysim import config, registry
from raysim.data import cifar, femnist, idx
from raysim.errors import ConfigError, DataError, RaysimError

BOUNDED = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # CI runs the same examples every time
)

# --- config loader -------------------------------------------------------------------------------

SECTIONS = [f.name for f in config.dataclasses.fields(config.Config)]


def _section_keys(section: str) -> list[str]:
    section_type = config._resolve_type(config._SECTION_TYPES[section].type)
    keys = [f.name for f in config.dataclasses.fields(section_type) if f.name != "options"]
    if section in config._PLUGIN_SECTIONS:
        reg = config._PLUGIN_SECTIONS[section][0]
        for name in reg.names():
            keys += reg.option_names(name)
    return sorted(set(keys))


KEYS = {section: _section_keys(section) for section in SECTIONS}
PLUGIN_NAMES = {
    section: config._PLUGIN_SECTIONS[section][0].names() for section in config._PLUGIN_SECTIONS
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "local", "ray", "sgd", "adam", "frl", "mlp", "iid", "-1", "1e-3"]),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), children, max_size=3),
    ),
    max_leaves=8,
)


@st.composite
def config_documents(draw) -> dict:
    """Mostly real sections and keys (so the checks deep inside are reached), some noise."""
    document: dict = {}
    for _ in range(draw(st.integers(0, 5))):
        section = draw(st.one_of(st.sampled_from(SECTIONS), st.text(max_size=6), st.integers()))
        keys = KEYS.get(section, []) + ["name"]
        body: dict = {}
        for _ in range(draw(st.integers(0, 4))):
            key = draw(st.one_of(st.sampled_from(keys), st.text(max_size=6)))
            if key == "name" and section in PLUGIN_NAMES and draw(st.booleans()):
                body[key] = draw(st.sampled_from(PLUGIN_NAMES[section]))
            else:
                body[key] = draw(values)
        document[section] = draw(st.one_of(st.just(body), values))
    return document


def _only_config_errors(action: Callable[[], object]) -> None:
    try:
        action()
    except ConfigError as error:
        assert str(error) and "\n" not in str(error).strip("\n")
    except RaysimError:
        pass


@BOUNDED
@given(document=config_documents())
def test_random_config_documents_raise_only_config_errors(document):
    path = Path(tempfile.mkdtemp()) / "config.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    _only_config_errors(lambda: config.load(path))


@BOUNDED
@given(text=st.text(max_size=300))
def test_random_yaml_text_raises_only_config_errors(text):
    path = Path(tempfile.mkdtemp()) / "config.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    _only_config_errors(lambda: config.load(path))


override_values = st.one_of(
    st.text(max_size=20),
    values.map(lambda value: yaml.safe_dump(value, default_flow_style=True).strip()),
    st.sampled_from(["!!timestamp 2001-13-01", "!!int x", "[1, 2", "{a: 1}", ".nan", "-.inf"]),
)


@BOUNDED
@given(
    overrides=st.lists(
        st.one_of(
            st.builds(
                lambda section, data: f"{section}.{data}",
                st.sampled_from(SECTIONS),
                st.text(max_size=8),
            ),
            st.sampled_from(SECTIONS).flatmap(
                lambda section: st.builds(
                    lambda key, value: f"{section}.{key}={value}",
                    st.sampled_from(KEYS[section] + ["name"]),
                    override_values,
                )
            ),
        ),
        max_size=4,
    )
)
def test_random_overrides_raise_only_config_errors(overrides):
    _only_config_errors(lambda: config.from_dict({}, overrides))


# --- data files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileFormat:
    """A data format under test: `build(folder)` writes a valid dataset into `folder` and
    returns (the file to corrupt, a function that loads the dataset through the real code)."""

    name: str
    build: Callable[[Path], tuple[Path, Callable[[], object]]]


def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _mnist(which: str, compress: bool) -> Callable[[Path], tuple[Path, Callable[[], object]]]:
    def build(folder: Path):
        raw = folder / "MNIST" / "raw"
        raw.mkdir(parents=True)
        images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
        labels = np.array([3, 7], dtype=np.uint8)
        files = {
            "train-images-idx3-ubyte": _idx(images),
            "train-labels-idx1-ubyte": _idx(labels),
            "t10k-images-idx3-ubyte": _idx(images),
            "t10k-labels-idx1-ubyte": _idx(labels),
        }
        for name, content in files.items():
            if compress and name == which:
                (raw / f"{name}.gz").write_bytes(gzip.compress(content, mtime=0))
            else:
                (raw / name).write_bytes(content)
        target = raw / (f"{which}.gz" if compress else which)
        return target, lambda: idx.load_mnist(str(folder), 0)

    return build


def _cifar_batch(labels: list[int]) -> dict:
    data = (np.arange(len(labels) * 3072) % 251).astype(np.uint8).reshape(len(labels), 3072)
    return {b"batch_label": b"testing batch", b"labels": labels, b"data": data}


def _cifar10(folder: Path):
    directory = folder / "cifar-10-batches-py"
    directory.mkdir()
    for name in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"):
        (directory / name).write_bytes(pickle.dumps(_cifar_batch([1, 9]), protocol=2))
    return directory / "data_batch_1", lambda: cifar.load_cifar10(str(folder), 0)


def _leaf_content(users: dict[str, list[int]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(labels) for labels in users.values()],
        "user_data": {
            user: {"x": [[0.5] * 784 for _ in labels], "y": labels}
            for user, labels in users.items()
        },
    }


def _femnist(folder: Path):
    (folder / "train").mkdir()
    (folder / "test").mkdir()
    (folder / "test" / "t.json").write_text(json.dumps(_leaf_content({"w0": [1]})))
    target = folder / "train" / "t.json"
    target.write_text(json.dumps(_leaf_content({"w0": [1, 61], "w1": [0]})))
    return target, lambda: femnist.load_femnist(str(folder), 0)


FORMATS = [
    FileFormat("mnist-images", _mnist("train-images-idx3-ubyte", compress=False)),
    FileFormat("mnist-labels", _mnist("train-labels-idx1-ubyte", compress=False)),
    FileFormat("mnist-images-gz", _mnist("t10k-images-idx3-ubyte", compress=True)),
    FileFormat("cifar10-pickle", _cifar10),
    FileFormat("femnist-leaf-json", _femnist),
]


def _optional(module: str, attribute: str) -> Callable | None:
    """A parser being written elsewhere: tested as soon as its module provides it."""
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return None


_parse_xc_file = _optional("raysim.data.xml", "parse_xc_file")
if _parse_xc_file is not None:

    def _xc_text(folder: Path):
        target = folder / "train.txt"
        target.write_text("3 6 4\n0,2 1:0.5 3:1\n 0:2.5\n3 5:1e-3 2:0.25\n")
        return target, lambda: _parse_xc_file(target)

    FORMATS.append(FileFormat("xc-text", _xc_text))

_read_split_file = _optional("raysim.data.xml", "read_split_file")
if _read_split_file is not None:

    def _xc_split(folder: Path):
        target = folder / "trSplit.txt"
        target.write_text("1 2\n3 1\n2 3\n")
        return target, lambda: _read_split_file(target, 1, 3)

    FORMATS.append(FileFormat("xc-split", _xc_split))


_load_arff = _optional("raysim.data.arff", "load_arff")
if _load_arff is not None:

    def _arff(folder: Path):
        target = folder / "train.arff"
        target.write_text(
            "% MULAN-style\n@relation 'tiny: -C 2'\n@attribute f1 numeric\n"
            "@attribute 'f two' real\n@attribute sunny {0,1}\n@attribute rainy {0,1}\n"
            "@data\n1.0,2.0,1,0\n3.0,-1.0,0,1\n{0 5.0,1 0.5,2 1,3 1}\n7.0,2.5,0,0\n"
        )
        return target, lambda: _load_arff(
            str(folder), 0, train_file="train.arff", labels=["sunny", "rainy"]
        )

    FORMATS.append(FileFormat("mulan-arff", _arff))

_read_coco = _optional("raysim.data.coco", "read_coco_annotations")
if _read_coco is not None:

    def _coco(folder: Path):
        target = folder / "instances_train2014.json"
        content = {
            "images": [{"id": 7, "file_name": "a.jpg"}, {"id": 3, "file_name": "b.jpg"}],
            "annotations": [
                {"image_id": 7, "category_id": 1},
                {"image_id": 3, "category_id": 90},
                {"image_id": 7, "category_id": 90},
            ],
            "categories": [{"id": 90, "name": "toothbrush"}, {"id": 1, "name": "person"}],
        }
        target.write_text(json.dumps(content))
        return target, lambda: _read_coco(str(target))

    FORMATS.append(FileFormat("coco-instances-json", _coco))


@pytest.fixture(scope="module")
def dataset_folders(tmp_path_factory):
    """One valid dataset folder per format, built on first use (module-scoped for hypothesis)."""
    built: dict[str, tuple[Path, bytes, Callable[[], object]]] = {}

    def get(fmt: FileFormat) -> tuple[Path, bytes, Callable[[], object]]:
        if fmt.name not in built:
            target, load = fmt.build(tmp_path_factory.mktemp(fmt.name))
            load()  # the untouched folder must load: the corruption is what the test varies
            built[fmt.name] = (target, target.read_bytes(), load)
        return built[fmt.name]

    return get


@st.composite
def corrupted(draw, valid: bytes) -> bytes:
    """Truncations, byte flips, spliced random bytes, or wholly random bytes."""
    kind = draw(st.sampled_from(["truncate", "flip", "splice", "random"]))
    if kind == "truncate":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if kind == "random":
        return draw(st.binary(max_size=512))
    content = bytearray(valid)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            content[draw(st.integers(0, len(content) - 1))] = draw(st.integers(0, 255))
        return bytes(content)
    start = draw(st.integers(0, len(content)))
    end = draw(st.integers(start, min(len(content), start + 64)))
    return bytes(content[:start]) + draw(st.binary(max_size=64)) + bytes(content[end:])


def _only_data_errors(load: Callable[[], object]) -> None:
    try:
        load()
    except DataError as error:
        assert str(error)


@pytest.mark.parametrize("fmt", FORMATS, ids=[fmt.name for fmt in FORMATS])
@BOUNDED
@given(data=st.data())
def test_corrupted_files_raise_only_data_errors(dataset_folders, fmt, data):
    target, valid, load = dataset_folders(fmt)
    try:
        target.write_bytes(data.draw(corrupted(valid), label="content"))
        _only_data_errors(load)
    finally:
        target.write_bytes(valid)


# --- well-formed containers with hostile contents --------------------------------------------

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=5),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)
pixels = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.booleans(),
    st.text(max_size=2),
    st.none(),
    st.lists(st.floats(0, 1), max_size=2),
)
labels = st.one_of(
    st.integers(0, 61),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=2),
    st.none(),
)


@st.composite
def leaf_documents(draw) -> str:
    """A LEAF file that is well formed except for a few hostile fields."""
    users = draw(st.lists(st.sampled_from(["w0", "w1", "w2"]), min_size=1, max_size=3))
    user_data: dict = {}
    for user in users:
        count = draw(st.integers(0, 2))
        width = draw(st.sampled_from([784, 784, 784, 783, 0]))
        rows = [[0.25] * width for _ in range(count)]
        for row in rows:
            for _ in range(draw(st.integers(0, 2)) if width else 0):
                row[draw(st.integers(0, width - 1))] = draw(pixels)
        ys = [draw(labels) for _ in range(count + draw(st.sampled_from([0, 0, 0, 1])))]
        record: dict = {"x": rows, "y": ys}
        if draw(st.integers(0, 9)) == 0:  # now and then, a record of the wrong shape
            record[draw(st.sampled_from(["x", "y"]))] = draw(json_values)
        if draw(st.integers(0, 9)):
            user_data[user] = record
    document: dict = {"users": users, "user_data": user_data}
    if draw(st.integers(0, 9)) == 0:
        document[draw(st.sampled_from(["users", "user_data"]))] = draw(json_values)
    return json.dumps(document, allow_nan=True)


def _leaf_with(**record) -> str:
    return json.dumps({"users": ["w0"], "user_data": {"w0": {"x": [[0.0] * 784], **record}}})


@BOUNDED
@given(document=leaf_documents())
@example(document=_leaf_with(y=[10**30]))  # overflowed converting to int64
@example(document=_leaf_with(x=[[10**400] * 784], y=[1]))  # overflowed converting to float
@example(document=_leaf_with(x=[[float("nan")] * 784], y=[1]))  # NaN pixels were accepted
@example(document=_leaf_with(x=[["1"] * 784], y=[1]))  # strings were converted silently
def test_hostile_leaf_json_raises_only_data_errors(dataset_folders, document):
    target, valid, load = dataset_folders(next(f for f in FORMATS if f.name.startswith("femnist")))
    try:
        target.write_text(document)
        _only_data_errors(load)
    finally:
        target.write_bytes(valid)


JSON_FORMATS = [fmt for fmt in FORMATS if fmt.name.endswith("json")]


@pytest.mark.parametrize("fmt", JSON_FORMATS, ids=[fmt.name for fmt in JSON_FORMATS])
def test_deeply_nested_or_overlong_json_is_a_data_error(dataset_folders, fmt):
    target, valid, load = dataset_folders(fmt)
    try:
        target.write_text("[" * 200_000 + "]" * 200_000)  # RecursionError in json
        with pytest.raises(DataError):
            load()
        target.write_text('{"users": [1' + "0" * 5000 + "]}")  # over int's digit limit
        with pytest.raises(DataError):
            load()
    finally:
        target.write_bytes(valid)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"x": [[float("nan")] * 784], "y": [1]}, "only finite numbers"),
        ({"x": [[1e300] * 784], "y": [1]}, "only finite numbers"),
        ({"x": [["0.5"] * 784], "y": [1]}, "only numbers"),
        ({"x": [[None] * 784], "y": [1]}, "only numbers"),
        ({"y": [10**30]}, "out of range"),
        ({"y": [1.0]}, "only integer labels"),
    ],
)
def test_leaf_values_that_were_accepted_or_crashed(dataset_folders, record, expected):
    target, valid, load = dataset_folders(next(f for f in FORMATS if f.name.startswith("femnist")))
    try:
        target.write_text(_leaf_with(**record))
        with pytest.raises(DataError, match=expected):
            load()
    finally:
        target.write_bytes(valid)


@pytest.mark.parametrize(
    ("labels", "expected"),
    [([1.5, 0.0], "must be a list of integers"), ([2**70, 0], "out of range")],
)
def test_cifar_labels_that_were_truncated_or_crashed(dataset_folders, labels, expected):
    target, valid, load = dataset_folders(next(f for f in FORMATS if f.name.startswith("cifar")))
    try:
        target.write_bytes(pickle.dumps({**_cifar_batch([0, 0]), b"labels": labels}, protocol=2))
        with pytest.raises(DataError, match=expected):
            load()
    finally:
        target.write_bytes(valid)


cifar_values = st.one_of(
    json_values,
    st.builds(
        lambda dtype, shape: np.zeros(shape, dtype=dtype),
        st.sampled_from([np.uint8, np.int64, np.float32, np.bool_, np.int8]),
        st.sampled_from([(2, 3072), (2,), (3072,), (1, 2, 3072), (0, 3072), ()]),
    ),
)
cifar_labels = st.one_of(
    st.lists(st.integers(0, 9), min_size=2, max_size=2),
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), min_size=2, max_size=2),
    st.lists(labels, min_size=2, max_size=2),
    st.lists(st.integers(0, 9), max_size=3).map(lambda values: np.asarray(values, dtype=np.int64)),
    cifar_values,
)


@st.composite
def cifar_batches(draw) -> dict:
    """A pickled CIFAR batch dict: valid images and hostile labels, or the reverse."""
    batch = {
        b"data": draw(st.one_of(st.just(_cifar_batch([0, 0])[b"data"]), cifar_values)),
        b"labels": draw(cifar_labels),
    }
    if draw(st.integers(0, 9)) == 0:
        del batch[draw(st.sampled_from([b"data", b"labels"]))]
    if draw(st.integers(0, 9)) == 0:
        batch = {draw(st.sampled_from(["data", "labels", 3, b"x"])): draw(cifar_values)}
    return batch


@BOUNDED
@given(batch=cifar_batches(), protocol=st.integers(2, pickle.HIGHEST_PROTOCOL))
@example(batch={**_cifar_batch([0, 0]), b"labels": [2**70, 0]}, protocol=2)  # overflowed
@example(batch={**_cifar_batch([0, 0]), b"labels": [1.5, 0.0]}, protocol=2)  # was truncated
def test_hostile_cifar_batches_raise_only_data_errors(dataset_folders, batch, protocol):
    target, valid, load = dataset_folders(next(f for f in FORMATS if f.name.startswith("cifar")))
    try:
        target.write_bytes(pickle.dumps(batch, protocol=protocol))
        _only_data_errors(load)
    finally:
        target.write_bytes(valid)


coco_ids = st.one_of(
    st.integers(0, 4),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=2),
    st.none(),
)


@st.composite
def coco_documents(draw) -> str:
    """An instances json whose records have hostile ids, names or shapes."""

    def records(fields: dict) -> list:
        return [
            {key: draw(strategy) for key, strategy in fields.items() if draw(st.integers(0, 9))}
            for _ in range(draw(st.integers(0, 3)))
        ]

    document = {
        "images": records({"id": coco_ids, "file_name": st.one_of(st.text(max_size=3), coco_ids)}),
        "annotations": records({"image_id": coco_ids, "category_id": coco_ids}),
        "categories": records({"id": coco_ids, "name": st.one_of(st.text(max_size=3), coco_ids)}),
    }
    if draw(st.integers(0, 4)) == 0:
        document[draw(st.sampled_from(list(document)))] = draw(json_values)
    return json.dumps(document, allow_nan=True)


COCO_FORMATS = [fmt for fmt in FORMATS if fmt.name.startswith("coco")]


@pytest.mark.parametrize("fmt", COCO_FORMATS, ids=[fmt.name for fmt in COCO_FORMATS])
@BOUNDED
@given(document=coco_documents())
def test_hostile_coco_json_raises_only_data_errors(dataset_folders, fmt, document):
    target, valid, load = dataset_folders(fmt)
    try:
        target.write_text(document)
        _only_data_errors(load)
    finally:
        target.write_bytes(valid)


def test_restricted_unpickler_refuses_code(dataset_folders):
    target, valid, load = dataset_folders(next(f for f in FORMATS if f.name.startswith("cifar")))

    class Exploit:
        def __reduce__(self):
            return (math.floor, (1.5,))

    try:
        target.write_bytes(pickle.dumps({b"data": Exploit()}, protocol=2))
        with pytest.raises(DataError, match="refusing to load .* math.floor"):
            load()
    finally:
        target.write_bytes(valid)


def test_every_registered_dataset_with_files_is_covered():
    """A file-reading dataset added to the registry should get a FileFormat above."""
    file_datasets = {"mnist", "cifar10", "cifar100", "femnist"}
    assert file_datasets <= set(registry.datasets.names())
