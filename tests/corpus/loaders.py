"""Hostile and clumsy data files for raysim's readers: CIFAR pickles, MNIST idx, MULAN ARFF (and
its labels XML), COCO annotations and images, LEAF/FEMNIST json, Extreme Classification text and
split files, and the parquet split cache.

Each case writes a small folder (every file under 10 MB, most a few KB) and loads it the way a
run would: `load_dataset` of a config built from `--set` style overrides, or, for the split
cache, `partition_for_run`. Every case must end in one RaysimError line, quickly and in bounded
memory: the bombs below would otherwise build GBs from KBs, and the FIFOs would block forever.

The `write_*` helpers build a valid dataset folder for each format (tests/test_hostile_loaders.py
uses them too); a case then spoils one file.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import Case

# --- loading the way a run does -------------------------------------------------------------------


def config_for(*overrides: str):
    """A run config from `--set` style overrides (the defaults for everything else)."""
    from raysim import config

    return config.from_dict({}, list(overrides))


def load(*overrides: str):
    """The dataset of a run configured by `overrides` (as `raysim run --set ...` loads it)."""
    from raysim.data.datasets import load_dataset

    return load_dataset(config_for(*overrides))


# --- valid dataset folders ------------------------------------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def write_mnist(folder: Path) -> Path:
    """MNIST/raw with 2 train and 2 test images; returns the raw folder."""
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = (np.arange(2 * 28 * 28) % 256).astype(np.uint8).reshape(2, 28, 28)
    labels = np.array([3, 7], dtype=np.uint8)
    for name in MNIST_FILES:
        (raw / name).write_bytes(idx_bytes(images if "images" in name else labels))
    return raw


def load_mnist(folder: Path):
    return load("data.name=mnist", f"data.root={folder}")


def cifar_batch(labels: list[int], label_key: bytes = b"labels") -> dict:
    data = (np.arange(len(labels) * 3072) % 251).astype(np.uint8).reshape(len(labels), 3072)
    return {b"batch_label": b"testing batch", label_key: labels, b"data": data}


CIFAR10_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch")


def write_cifar10(folder: Path) -> Path:
    """cifar-10-batches-py with 2 images per batch (pickled as Python 3 does, protocol 2)."""
    directory = folder / "cifar-10-batches-py"
    directory.mkdir()
    for name in CIFAR10_FILES:
        (directory / name).write_bytes(pickle.dumps(cifar_batch([1, 9]), protocol=2))
    return directory


def write_cifar100(folder: Path) -> Path:
    directory = folder / "cifar-100-python"
    directory.mkdir()
    for name in ("train", "test"):
        batch = cifar_batch([5, 99], b"fine_labels")
        (directory / name).write_bytes(pickle.dumps(batch, protocol=2))
    return directory


def load_cifar10(folder: Path):
    return load("data.name=cifar10", f"data.root={folder}")


def leaf_document(users: dict[str, list[int]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(labels) for labels in users.values()],
        "user_data": {
            user: {"x": [[0.5] * 784 for _ in labels], "y": labels}
            for user, labels in users.items()
        },
    }


def write_femnist(folder: Path) -> Path:
    """train/ and test/ LEAF json; returns the train file."""
    (folder / "train").mkdir()
    (folder / "test").mkdir()
    (folder / "test" / "t.json").write_text(json.dumps(leaf_document({"w0": [1]})))
    target = folder / "train" / "t.json"
    target.write_text(json.dumps(leaf_document({"w0": [1, 61], "w1": [0]})))
    return target


def load_femnist(folder: Path):
    return load("data.name=femnist", f"data.root={folder}")


ARFF = (
    "% MULAN-style\n@relation 'tiny: -C 2'\n@attribute f1 numeric\n"
    "@attribute 'f two' real\n@attribute sunny {0,1}\n@attribute rainy {0,1}\n"
    "@data\n1.0,2.0,1,0\n3.0,-1.0,0,1\n{0 5.0,1 0.5,2 1,3 1}\n7.0,2.5,0,0\n"
)
MULAN_XML = (
    '<?xml version="1.0" encoding="utf-8"?>\n'
    '<labels xmlns="http://mulan.sourceforge.net/labels">\n'
    '<label name="sunny"></label>\n<label name="rainy"></label>\n</labels>\n'
)


def load_arff(folder: Path, *extra: str, labels: str = "[sunny, rainy]"):
    options = [f"data.labels={labels}"] if labels else []
    return load(
        "data.name=arff", f"data.root={folder}", "data.train_file=train.arff", *options, *extra
    )


def png_bytes(width: int, height: int, rows: int | None = None) -> bytes:
    """A 1-bit greyscale PNG of zeros, written row by row (no image of that size in memory);
    `rows` < height writes only that many rows (a truncated image)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    compressor = zlib.compressobj(9)
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the packed pixels
    compressed = [compressor.compress(row) for _ in range(height if rows is None else rows)]
    compressed.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", b"".join(compressed))
        + chunk(b"IEND", b"")
    )


def coco_document(image_ids: list[int]) -> dict:
    return {
        "images": [{"id": i, "file_name": f"COCO_{i:012d}.jpg"} for i in image_ids],
        "annotations": [{"image_id": i, "category_id": 1 + i % 2} for i in image_ids],
        "categories": [{"id": 1, "name": "person"}, {"id": 2, "name": "car"}],
    }


def write_coco(folder: Path) -> dict[str, Path]:
    """annotations/, train2014/ and val2014/ with tiny PNG images; returns the two json paths."""
    from PIL import Image

    (folder / "annotations").mkdir()
    paths = {}
    for split, ids in (("train2014", [1, 2]), ("val2014", [3])):
        (folder / split).mkdir()
        for image_id in ids:
            Image.new("RGB", (10, 6), (200, 30, 30)).save(
                folder / split / f"COCO_{image_id:012d}.jpg", format="PNG"
            )
        paths[split] = folder / "annotations" / f"instances_{split}.json"
        paths[split].write_text(json.dumps(coco_document(ids)))
    return paths


def load_coco(folder: Path):
    return load("data.name=coco", f"data.root={folder}", "data.image_size=8")


XC_TRAIN = "3 6 4\n0,2 1:0.5 3:1\n1 0:2.5\n3 5:1e-3 2:0.25\n"
XC_TEST = "2 6 4\n1 1:1\n0,3 4:0.5\n"


def write_xc(folder: Path) -> None:
    (folder / "train.txt").write_text(XC_TRAIN)
    (folder / "test.txt").write_text(XC_TEST)


def load_xc(folder: Path, name: str = "extreme_classification", *extra: str):
    return load(f"data.name={name}", f"data.root={folder}", *extra)


def split_cache_run(folder: Path, num_clients: int = 10):
    """(config, dataset) of a digits run whose split is cached in `folder`/cache."""
    cfg = config_for(
        "data.name=digits",
        "partition.name=iid",
        f"partition.num_clients={num_clients}",
        f"partition.cache_dir={folder / 'cache'}",
    )
    from raysim.data.datasets import load_dataset

    return cfg, load_dataset(cfg)


def cached_split_file(folder: Path) -> Path:
    """Run the split once so the cache holds its file; returns that file."""
    from raysim.assembly.plan import partition_for_run

    cfg, dataset = split_cache_run(folder)
    partition_for_run(cfg, dataset)
    (path,) = (folder / "cache").glob("split_*.parquet")
    return path


def split_again(folder: Path):
    """A second run with the same config: it reads the cached split."""
    from raysim.assembly.plan import partition_for_run

    cfg, dataset = split_cache_run(folder)
    return partition_for_run(cfg, dataset)


def write_split_table(path: Path, indices, offsets, *, value_type=None, metadata=b"{}", **kw):
    """A parquet file in the split cache's format, with any contents (and pyarrow options)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    value_type = value_type or pa.int64()

    def column(values) -> pa.Array:
        flat = pa.array(values, type=value_type)
        return pa.LargeListArray.from_arrays(pa.array([0, len(flat)], type=pa.int64()), flat)

    table = pa.table({"indices": column(indices), "offsets": column(offsets)})
    table = table.replace_schema_metadata(
        {b"raysim.format": b"client_split/1", b"raysim.metadata": metadata}
    )
    pq.write_table(table, path, **kw)


def fifo(path: Path) -> Path:
    """A named pipe at `path` (replacing any file): opening it to read would block forever."""
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mkfifo(path)
    return path


def folder_at(path: Path) -> Path:
    if path.exists():
        path.unlink()
    path.mkdir()
    return path


# --- hand-written pickles (protocol 2 opcodes) -------------------------------------------------


def _unicode(text: str) -> bytes:
    data = text.encode("utf-8")
    return b"X" + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(value: int) -> bytes:
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _batch_pickle(data_value: bytes, labels: list[int] | None = None, prefix: bytes = b"") -> bytes:
    """{'data': <data_value opcodes>, 'labels': [...]} with `prefix` opcodes run first."""
    labels = [1, 9] if labels is None else labels
    label_ops = b"](" + b"".join(_int(label) for label in labels) + b"e"
    return (
        b"\x80\x02"
        + prefix
        + b"}("
        + _unicode("data")
        + data_value
        + _unicode("labels")
        + label_ops
        + b"u."
    )


def codecs_hex_bomb(levels: int, seed: int = 800) -> bytes:
    """_codecs.encode(... _codecs.encode(_codecs.encode('x' * seed, 'latin1'), 'hex') ...,
    'hex'), `levels` deep: each level costs 6 bytes of file and doubles the bytes built."""
    prefix = (
        _global("_codecs", "encode") + b"q\x00" + b"0"  # memo 0: encode
        + _unicode("hex") + b"q\x01" + b"0"
        + _unicode("latin1") + b"q\x02" + b"0"
    )  # fmt: skip
    value = (
        b"h\x00" * (levels + 1)
        + _unicode("x" * seed)
        + b"h\x02\x86R"  # encode('x' * seed, 'latin1')
        + b"h\x01\x86R" * levels  # encode(<that>, 'hex'), again and again
    )
    return _batch_pickle(value, prefix=prefix)


def latin1_reuse_bomb(text_bytes: int, copies: int) -> bytes:
    """A list of `copies` _codecs.encode(T, 'latin1') of one memoised text T: 8 bytes of file
    per copy of T (only allow-listed calls, each building what the file holds once)."""
    prefix = (
        _global("_codecs", "encode") + b"q\x00" + b"0"
        + _unicode("a" * text_bytes) + b"q\x01" + b"0"
        + _unicode("latin1") + b"q\x02" + b"0"
    )  # fmt: skip
    value = b"](" + b"h\x00h\x01h\x02\x86R" * copies + b"e"
    return _batch_pickle(value, prefix=prefix)


def reconstruct_bomb(rows: int) -> bytes:
    """numpy's _reconstruct(ndarray, (rows, 3072), 'B'): an uninitialised array of the shape
    the pickle asks for (no data in the file), with as many labels, so the batch looks whole."""
    value = (
        _global("numpy.core.multiarray", "_reconstruct")
        + _global("numpy", "ndarray")
        + b"(" + _int(rows) + _int(3072) + b"t"
        + _unicode("B")
        + b"\x87R"
    )  # fmt: skip
    return _batch_pickle(value, labels=[0] * rows)


def object_array_pickle() -> bytes:
    """An object-dtype array whose state claims 10**9 items and holds 2: numpy's setstate
    crashes the interpreter (segmentation fault) on it."""
    dtype = _global("numpy", "dtype") + _unicode("O8") + b"\x89\x88\x87R"
    dtype += b"(" + _int(3) + _unicode("|") + b"NNN" + _int(-1) + _int(-1) + _int(63) + b"tb"
    value = (
        _global("numpy.core.multiarray", "_reconstruct")
        + _global("numpy", "ndarray")
        + _int(0) + b"\x85"
        + _global("_codecs", "encode") + _unicode("b") + _unicode("latin1") + b"\x86R"
        + b"\x87R"
        + b"(" + _int(1) + b"(" + _int(10**9) + b"t" + dtype + b"\x89]("
        + _int(1) + _int(2) + b"et" + b"b"
    )  # fmt: skip
    return _batch_pickle(value)


def spoil_cifar_batch(folder: Path, content: bytes, name: str = "data_batch_1") -> Path:
    directory = write_cifar10(folder)
    (directory / name).write_bytes(content)
    return directory / name


# --- the cases --------------------------------------------------------------------------------

CASES: list[Case] = []


def case(name: str, timeout_s: float = 30.0) -> Callable[[Callable[[Path], object]], Callable]:
    def register(run: Callable[[Path], object]) -> Callable[[Path], object]:
        CASES.append(Case(name, run, timeout_s))
        return run

    return register


# CIFAR python batches ------------------------------------------------------------------------


@case("cifar/pickle-codecs-hex-bomb")
def _(folder: Path):
    # 22 levels: 1.6 KB of file asking for 800 * 2**22 bytes = 3.4 GB
    spoil_cifar_batch(folder, codecs_hex_bomb(22))
    return load_cifar10(folder)


@case("cifar/pickle-latin1-reuse-bomb")
def _(folder: Path):
    # 1 MB of text encoded 4,000 times: 1.1 MB of file, 4 GB of bytes
    spoil_cifar_batch(folder, latin1_reuse_bomb(1 << 20, 4000))
    return load_cifar10(folder)


@case("cifar/pickle-bytes-of-a-huge-int")
def _(folder: Path):
    value = _global("builtins", "bytes") + _int(10**10) + b"\x85R"  # bytes(10**10): 10 GB
    spoil_cifar_batch(folder, _batch_pickle(value))
    return load_cifar10(folder)


@case("cifar/pickle-uninitialised-array-of-any-shape")
def _(folder: Path):
    # 200,000 x 3072 (600 MB, 2.4 GB as float32 after normalising) from 400 KB of labels
    spoil_cifar_batch(folder, reconstruct_bomb(200_000))
    return load_cifar10(folder)


@case("cifar/pickle-object-array-crashes-numpy")
def _(folder: Path):
    spoil_cifar_batch(folder, object_array_pickle())
    return load_cifar10(folder)


@case("cifar/pickle-ndarray-new-with-a-shape")
def _(folder: Path):
    # NEWOBJ: numpy.ndarray.__new__(ndarray, (10**6, 3072)), without _reconstruct
    value = _global("numpy", "ndarray") + b"(" + _int(10**6) + _int(3072) + b"t\x85\x81"
    spoil_cifar_batch(folder, _batch_pickle(value))
    return load_cifar10(folder)


@case("cifar/pickle-calls-os-system")
def _(folder: Path):
    value = _global("os", "system") + _unicode("echo pwned") + b"\x85R"
    spoil_cifar_batch(folder, _batch_pickle(value))
    return load_cifar10(folder)


@case("cifar/truncated-batch")
def _(folder: Path):
    valid = pickle.dumps(cifar_batch([1, 9]), protocol=2)
    spoil_cifar_batch(folder, valid[: len(valid) // 2])
    return load_cifar10(folder)


@case("cifar/fifo-instead-of-a-batch")
def _(folder: Path):
    fifo(write_cifar10(folder) / "data_batch_3")
    return load_cifar10(folder)


@case("cifar/folder-instead-of-a-batch")
def _(folder: Path):
    folder_at(write_cifar10(folder) / "test_batch")
    return load_cifar10(folder)


@case("cifar/float-pixels-with-nan")
def _(folder: Path):
    batch = cifar_batch([1, 9])
    batch[b"data"] = np.full((2, 3072), np.nan)
    spoil_cifar_batch(folder, pickle.dumps(batch, protocol=2))
    return load_cifar10(folder)


@case("cifar/negative-label")
def _(folder: Path):
    spoil_cifar_batch(folder, pickle.dumps(cifar_batch([-1, 9]), protocol=2))
    return load_cifar10(folder)


@case("cifar/data-shorter-than-its-shape")
def _(folder: Path):
    # a numpy array state whose raw bytes are fewer than its shape needs
    value = (
        _global("numpy.core.multiarray", "_reconstruct")
        + _global("numpy", "ndarray") + _int(0) + b"\x85" + _unicode("b") + b"\x87R"
        + b"(" + _int(1) + b"(" + _int(2) + _int(3072) + b"t"
        + _global("numpy", "dtype") + _unicode("u1") + b"\x89\x88\x87R"
        + b"\x89" + b"U\x04abcd" + b"tb"
    )  # fmt: skip
    spoil_cifar_batch(folder, _batch_pickle(value))
    return load_cifar10(folder)


@case("cifar100/huge-label")
def _(folder: Path):
    directory = write_cifar100(folder)
    batch = cifar_batch([2**70, 3], b"fine_labels")
    (directory / "train").write_bytes(pickle.dumps(batch, protocol=2))
    return load("data.name=cifar100", f"data.root={folder}")


# MNIST idx ------------------------------------------------------------------------------------


@case("mnist/idx-header-promises-more-than-the-file")
def _(folder: Path):
    raw = write_mnist(folder)
    header = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 60_000, 28, 28)
    (raw / "train-images-idx3-ubyte").write_bytes(header + bytes(100))
    return load_mnist(folder)


@case("mnist/idx-gz-whose-header-promises-terabytes")
def _(folder: Path):
    raw = write_mnist(folder)
    header = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 4_000_000_000, 1000, 1000)
    with gzip.open(raw / "train-images-idx3-ubyte.gz", "wb") as handle:
        handle.write(header + bytes(1 << 20))
    (raw / "train-images-idx3-ubyte").unlink()
    return load_mnist(folder)


@case("mnist/idx-fifo")
def _(folder: Path):
    fifo(write_mnist(folder) / "t10k-labels-idx1-ubyte")
    return load_mnist(folder)


@case("mnist/idx-float-data-type")
def _(folder: Path):
    raw = write_mnist(folder)
    header = bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 2)
    (raw / "train-labels-idx1-ubyte").write_bytes(header + struct.pack(">2f", np.nan, 1.0))
    return load_mnist(folder)


@case("mnist/idx-truncated-header")
def _(folder: Path):
    (write_mnist(folder) / "train-images-idx3-ubyte").write_bytes(bytes([0, 0, 0x08, 3, 0, 0]))
    return load_mnist(folder)


@case("mnist/idx-label-out-of-range")
def _(folder: Path):
    raw = write_mnist(folder)
    (raw / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([3, 200], dtype=np.uint8)))
    return load_mnist(folder)


@case("mnist/idx-more-labels-than-images")
def _(folder: Path):
    raw = write_mnist(folder)
    (raw / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([1, 2, 3], dtype=np.uint8)))
    return load_mnist(folder)


# MULAN ARFF ---------------------------------------------------------------------------------


@case("arff/sparse-rows-densify-bomb")
def _(folder: Path):
    # 50,000 attributes x 6,000 empty sparse rows: 1.3 MB of file, 2.4 GB of dense float64
    header = "".join(f"@attribute a{i} numeric\n" for i in range(50_000))
    text = "@relation bomb\n" + header + "@attribute sunny {0,1}\n@data\n" + "{}\n" * 6000
    (folder / "train.arff").write_text(text)
    return load_arff(folder, labels="[sunny]")


@case("arff/thousands-of-labels-then-a-bad-value")
def _(folder: Path):
    # 20,000 attributes of which 10,000 labels: the label lookup must not be quadratic
    names = [f"l{i}" for i in range(10_000)] + [f"f{i}" for i in range(10_000)]
    header = "".join(f"@attribute {name} {{0,1}}\n" for name in names)
    rows = "{0 1,10000 1}\n{1 1,19999 2}\n"  # row 2: feature f9999 = 2, not in {0,1}
    (folder / "train.arff").write_text("@relation many\n" + header + "@data\n" + rows)
    return load_arff(folder, labels="[" + ", ".join(names[:10_000]) + "]")


@case("arff/fifo")
def _(folder: Path):
    fifo(folder / "train.arff")
    return load_arff(folder)


@case("arff/nan-value")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF.replace("3.0,-1.0,0,1", "nan,-1.0,0,1"))
    return load_arff(folder)


@case("arff/superscript-sparse-index")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF.replace("{0 5.0,", "{\u00b2 5.0,"))
    return load_arff(folder)


@case("arff/five-thousand-digit-sparse-index")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF.replace("{0 5.0,", "{" + "9" * 5000 + " 5.0,"))
    return load_arff(folder)


@case("arff/sparse-index-given-twice")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF.replace("{0 5.0,1 0.5,", "{0 5.0,0 0.5,"))
    return load_arff(folder)


@case("arff/attribute-declared-twice")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF.replace("@attribute 'f two'", "@attribute 'rainy'"))
    return load_arff(folder)


@case("arff/no-data-section")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF.split("@data")[0])
    return load_arff(folder)


@case("arff/labels-xml-billion-laughs")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF)
    entities = '<!ENTITY a0 "laugh">' + "".join(
        f'<!ENTITY a{i} "{f"&a{i - 1};" * 10}">' for i in range(1, 10)
    )
    (folder / "labels.xml").write_text(
        f'<?xml version="1.0"?><!DOCTYPE labels [{entities}]><labels><label name="&a9;"/></labels>'
    )
    return load_arff(folder, "data.xml_file=labels.xml", labels="")


@case("arff/labels-xml-fifo")
def _(folder: Path):
    (folder / "train.arff").write_text(ARFF)
    fifo(folder / "labels.xml")
    return load_arff(folder, "data.xml_file=labels.xml", labels="")


# COCO ---------------------------------------------------------------------------------------


@case("coco/label-matrix-bomb")
def _(folder: Path):
    # 80,000 images x 80,000 categories in 5 MB of JSON: a 6.4 GB label matrix
    paths = write_coco(folder)
    document = {
        "images": [{"id": i, "file_name": "x"} for i in range(80_000)],
        "annotations": [],
        "categories": [{"id": i, "name": ""} for i in range(80_000)],
    }
    paths["train2014"].write_text(json.dumps(document, separators=(",", ":")))
    return load_coco(folder)


@case("coco/png-decompression-bomb")
def _(folder: Path):
    paths = write_coco(folder)
    (folder / "train2014" / "COCO_000000000001.jpg").write_bytes(png_bytes(30_000, 30_000, 10))
    del paths
    return load_coco(folder)


@case("coco/png-below-pils-limit-but-huge")
def _(folder: Path):
    # 10,000 x 10,000: PIL only warns below twice its limit and would decode 300 MB of RGB
    write_coco(folder)
    (folder / "train2014" / "COCO_000000000002.jpg").write_bytes(png_bytes(10_000, 10_000))
    return load_coco(folder)


@case("coco/truncated-image")
def _(folder: Path):
    write_coco(folder)
    image = folder / "train2014" / "COCO_000000000001.jpg"
    image.write_bytes(png_bytes(200, 200)[:-40])
    return load_coco(folder)


@case("coco/postscript-named-jpg")
def _(folder: Path):
    write_coco(folder)
    image = folder / "train2014" / "COCO_000000000001.jpg"
    image.write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    return load_coco(folder)


def _spoil_coco(folder: Path, change: Callable[[dict], None]):
    paths = write_coco(folder)
    document = json.loads(paths["train2014"].read_text())
    change(document)
    paths["train2014"].write_text(json.dumps(document))
    return load_coco(folder)


@case("coco/duplicate-category-ids")
def _(folder: Path):
    return _spoil_coco(folder, lambda d: d["categories"].append({"id": 1, "name": "bicycle"}))


@case("coco/duplicate-image-ids")
def _(folder: Path):
    return _spoil_coco(folder, lambda d: d["images"].append({"id": 2, "file_name": "other.jpg"}))


@case("coco/file-name-climbs-out-of-the-folder")
def _(folder: Path):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(folder / "outside.png")

    def change(document: dict) -> None:
        document["images"][0]["file_name"] = "../outside.png"

    return _spoil_coco(folder, change)


@case("coco/file-name-absolute")
def _(folder: Path):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(folder / "outside.png")

    def change(document: dict) -> None:
        document["images"][1]["file_name"] = str(folder / "outside.png")

    return _spoil_coco(folder, change)


@case("coco/image-fifo")
def _(folder: Path):
    write_coco(folder)
    fifo(folder / "val2014" / "COCO_000000000003.jpg")
    return load_coco(folder)


@case("coco/annotations-fifo")
def _(folder: Path):
    paths = write_coco(folder)
    fifo(paths["val2014"])
    return load_coco(folder)


@case("coco/nan-category-id")
def _(folder: Path):
    paths = write_coco(folder)
    text = paths["train2014"].read_text().replace('"category_id": 2', '"category_id": NaN')
    paths["train2014"].write_text(text)
    return load_coco(folder)


# LEAF / FEMNIST json --------------------------------------------------------------------------


@case("femnist/fifo-json")
def _(folder: Path):
    write_femnist(folder)
    fifo(folder / "test" / "z.json")
    return load_femnist(folder)


@case("femnist/folder-named-json")
def _(folder: Path):
    write_femnist(folder)
    (folder / "train" / "u.json").mkdir()
    return load_femnist(folder)


@case("femnist/pixels-as-nested-lists")
def _(folder: Path):
    # each row is 784 lists of 784 numbers: it passed the length check and loaded 784 times
    # as many images as labels
    target = write_femnist(folder)
    document = {"users": ["w0"], "user_data": {"w0": {"x": [[[0.5] * 784] * 784], "y": [3]}}}
    target.write_text(json.dumps(document))
    return load_femnist(folder)


@case("femnist/nan-pixels")
def _(folder: Path):
    target = write_femnist(folder)
    document = leaf_document({"w0": [1]})
    document["user_data"]["w0"]["x"][0][5] = float("nan")
    target.write_text(json.dumps(document))
    return load_femnist(folder)


@case("femnist/deeply-nested-json")
def _(folder: Path):
    (write_femnist(folder)).write_text("[" * 200_000 + "]" * 200_000)
    return load_femnist(folder)


@case("femnist/user-listed-twice")
def _(folder: Path):
    target = write_femnist(folder)
    document = leaf_document({"w0": [1, 2]})
    document["users"] = ["w0", "w0"]
    target.write_text(json.dumps(document))
    return load_femnist(folder)


@case("femnist/huge-label")
def _(folder: Path):
    target = write_femnist(folder)
    document = leaf_document({"w0": [1]})
    document["user_data"]["w0"]["y"] = [10**30]
    target.write_text(json.dumps(document))
    return load_femnist(folder)


# Extreme Classification text and split files ------------------------------------------------


def _xc_with_train(
    folder: Path, text: str, test: str | None = None, name: str = "extreme_classification"
):
    write_xc(folder)
    (folder / "train.txt").write_text(text)
    if test is not None:
        (folder / "test.txt").write_text(test)
    return load_xc(folder, name)


@case("xc/superscript-digit-in-header")
def _(folder: Path):
    return _xc_with_train(folder, XC_TRAIN.replace("3 6 4", "3 \u00b2 4"))


@case("xc/header-with-2-to-the-32-features")
def _(folder: Path):
    # ids up to 2**32 would pass the range check and wrap around in int32
    return _xc_with_train(folder, "1 4294967296 4\n0 3000000000:1\n")


@case("xc/feature-id-2-to-the-31")
def _(folder: Path):
    return _xc_with_train(folder, "1 2147483647 4\n0 2147483648:1\n")


@case("xc/header-asks-for-10-to-the-12-labels")
def _(folder: Path):
    text = "1 6 1000000000000\n0 1:1\n"
    return _xc_with_train(folder, text, text, name="xc_multilabel")


@case("xc/multilabel-dense-label-bomb")
def _(folder: Path):
    # 2**31 - 1 labels is a valid count, but FLAG's dense multi-hot targets would be 4 GB
    text = "1 6 2147483647\n0 1:1\n"
    return _xc_with_train(folder, text, text, name="xc_multilabel")


@case("xc/header-promises-more-points-than-bytes")
def _(folder: Path):
    return _xc_with_train(folder, "1000000000000000 6 4\n0 1:1\n")


@case("xc/five-thousand-digit-label")
def _(folder: Path):
    return _xc_with_train(folder, "1 6 4\n" + "9" * 5000 + " 1:1\n")


@case("xc/nan-feature-value")
def _(folder: Path):
    return _xc_with_train(folder, XC_TRAIN.replace("3:1", "3:nan"))


@case("xc/fifo")
def _(folder: Path):
    write_xc(folder)
    fifo(folder / "test.txt")
    return load_xc(folder)


@case("xc/binary-garbage-line")
def _(folder: Path):
    return _xc_with_train(folder, "2 6 4\n0 1:1\n\xff\xfe\x00 2:1\n")


def _xc_split_case(folder: Path, split_text: str | None):
    (folder / "data.txt").write_text(XC_TRAIN)
    (folder / "tstSplit.txt").write_text("1\n2\n")
    if split_text is None:
        fifo(folder / "trSplit.txt")
    else:
        (folder / "trSplit.txt").write_text(split_text)
    return load_xc(folder, "extreme_classification", "data.data_file=data.txt")


@case("xc-split/row-zero")
def _(folder: Path):
    return _xc_split_case(folder, "1\n0\n")  # rows are 1-based: 0 would become -1


@case("xc-split/negative-row")
def _(folder: Path):
    return _xc_split_case(folder, "1\n-2\n")


@case("xc-split/five-thousand-digit-row")
def _(folder: Path):
    return _xc_split_case(folder, "1\n" + "9" * 5000 + "\n")


@case("xc-split/fifo")
def _(folder: Path):
    return _xc_split_case(folder, None)


# the split cache (partition.cache_dir) ------------------------------------------------------


def _replace_cache(folder: Path, indices, offsets, **options):
    path = cached_split_file(folder)
    write_split_table(path, indices, offsets, **options)
    return split_again(folder)


@case("split-cache/negative-ids")
def _(folder: Path):
    # -1 would index from the end: clients silently trained on other samples
    ids = np.arange(1347, dtype=np.int64)
    ids[5] = -1
    return _replace_cache(folder, ids, np.linspace(0, 1347, 11).astype(np.int64))


@case("split-cache/ids-beyond-the-dataset")
def _(folder: Path):
    ids = np.arange(1347, dtype=np.int64) + 1000
    return _replace_cache(folder, ids, np.linspace(0, 1347, 11).astype(np.int64))


@case("split-cache/wrong-number-of-clients")
def _(folder: Path):
    return _replace_cache(folder, np.arange(1347), np.array([0, 700, 1347]))


@case("split-cache/float-ids")
def _(folder: Path):
    import pyarrow as pa

    ids = np.arange(1347) + 0.5  # int64 conversion would truncate them silently
    offsets = np.linspace(0, 1347, 11)
    return _replace_cache(folder, ids, offsets, value_type=pa.float64())


@case("split-cache/null-ids")
def _(folder: Path):
    ids: list = list(range(1347))
    ids[3] = None
    return _replace_cache(folder, ids, np.linspace(0, 1347, 11).astype(np.int64))


@case("split-cache/parquet-bomb")
def _(folder: Path):
    # 5 million zeros run-length encoded: a KB of file, 40 MB decoded (and as many GB as the
    # writer likes)
    zeros = np.zeros(5_000_000, dtype=np.int64)
    offsets = np.array([0] * 10 + [len(zeros)], dtype=np.int64)
    return _replace_cache(folder, zeros, offsets, use_dictionary=True, compression="zstd")


@case("split-cache/metadata-not-an-object")
def _(folder: Path):
    ids = np.arange(1347, dtype=np.int64)
    offsets = np.linspace(0, 1347, 11).astype(np.int64)
    return _replace_cache(folder, ids, offsets, metadata=b"[1, 2]")


@case("split-cache/truncated")
def _(folder: Path):
    path = cached_split_file(folder)
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])
    return split_again(folder)


@case("split-cache/fifo")
def _(folder: Path):
    fifo(cached_split_file(folder))
    return split_again(folder)
