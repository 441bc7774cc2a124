"""Regression tests for hostile data files: each is named after the item it holds.

Every test here failed (a stray exception, a hang, memory in GBs, or silently wrong data) before
the readers were fixed. Files are built with the helpers of the hostile-input corpus
(tests/corpus/loaders.py), whose cases cover the same ground at full size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from corpus.loaders import (
    cached_split_file,
    coco_document,
    codecs_hex_bomb,
    fifo,
    latin1_reuse_bomb,
    load_arff,
    load_cifar10,
    load_coco,
    load_femnist,
    load_xc,
    object_array_pickle,
    png_bytes,
    split_again,
    spoil_cifar_batch,
    write_cifar10,
    write_coco,
    write_femnist,
    write_split_table,
    write_xc,
)

from raysim.data import arff, coco
from raysim.errors import DataError

MB = 1 << 20


def _peak_traced_bytes(action: Callable[[], object]) -> int:
    """Peak bytes Python and numpy allocate while `action` runs (tracemalloc sees both)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _raises_quickly(action: Callable[[], object], fifos: list[Path], match: str) -> None:
    """`action` raises DataError matching `match` within 10 s. A reader blocked on a FIFO (the
    defect) is released by opening the FIFO for writing, so the test fails instead of hanging."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as error:  # handed to the test thread
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        for path in fifos:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # EOF for the reader
            except OSError:
                pass
        thread.join(10)
        pytest.fail(f"the reader blocked on {fifos} instead of refusing it")
    with pytest.raises(DataError, match=match):
        if outcome[0] is not None:
            raise outcome[0]


# --- 1. CIFAR: allow-listed constructors cannot multiply what the file holds ----------------------


def test_1_cifar_pickle_codecs_growth_is_refused_before_it_is_built(tmp_path):
    # nested _codecs.encode(..., 'hex'): 1.6 KB that built 800 * 2**17 = 105 MB (2**22: 3.4 GB)
    spoil_cifar_batch(tmp_path, codecs_hex_bomb(17))

    def load_hex_bomb() -> None:
        with pytest.raises(DataError, match=r"refusing to load .*_codecs\.encode\(bytes, 'hex'\)"):
            load_cifar10(tmp_path)

    assert _peak_traced_bytes(load_hex_bomb) < 16 * MB
    # latin1, the one encoding real batches use, reused on one memoised 64 KB text 2,000 times:
    # 131 MB from 80 KB of file; refused once it passes 4x the file's size
    (tmp_path / "reuse").mkdir()
    spoil_cifar_batch(tmp_path / "reuse", latin1_reuse_bomb(1 << 16, 2000))

    def load_reuse_bomb() -> None:
        with pytest.raises(DataError, match=r"builds more than [\d,]+ bytes of objects from"):
            load_cifar10(tmp_path / "reuse")

    assert _peak_traced_bytes(load_reuse_bomb) < 16 * MB


def test_1_cifar_object_dtype_pickle_cannot_crash_numpy(tmp_path):
    # an object array whose state claims 10**9 items and holds 2: numpy's setstate segfaulted
    # (run in a child, so that the crash it was shows as a failure, not a dead test run)
    spoil_cifar_batch(tmp_path, object_array_pickle())
    script = textwrap.dedent(
        f"""
        from raysim.data.cifar import load_cifar10
        from raysim.errors import DataError
        try:
            load_cifar10({str(tmp_path)!r}, 0)
        except DataError as error:
            print("DataError:", error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-500:]}"
    assert "DataError: refusing to load" in done.stdout and "numpy.dtype('object')" in done.stdout


# --- 2. ARFF: the dense table is bounded before it is allocated; label lookup is linear -----------


def test_2_arff_dense_size_is_checked_before_allocating_and_labels_are_found_fast(
    tmp_path, monkeypatch
):
    # the real bound (2**28 values) is met by 50,000 attributes x 6,000 rows "{}" (1.3 MB of
    # file, 2.4 GB of rows, the corpus case); here the same check with a bound of 1,000 values
    monkeypatch.setattr(arff, "ARFF_DENSE_LIMIT", 1000, raising=False)
    header = "".join(f"@attribute a{i} numeric\n" for i in range(100))
    (tmp_path / "train.arff").write_text(
        "@relation r\n" + header + "@attribute sunny {0,1}\n@data\n" + "{}\n" * 20
    )
    with pytest.raises(DataError, match=r"train\.arff: 20 rows x 101 attributes is too large"):
        load_arff(tmp_path, labels="[sunny]")
    monkeypatch.undo()
    # 20,000 labels among 40,000 attributes: the label lookups were quadratic (42 s; 2.4 s
    # for half as many), now linear (0.6 s)
    names = [f"l{i}" for i in range(20_000)] + [f"f{i}" for i in range(20_000)]
    header = "".join(f"@attribute {name} {{0,1}}\n" for name in names)
    (tmp_path / "train.arff").write_text(
        "@relation r\n" + header + "@data\n{0 1,20000 1}\n{1 1,39999 1}\n"
    )
    started = time.perf_counter()
    data = arff.load_arff(
        str(tmp_path), 0, train_file="train.arff", labels=names[:20_000], test_fraction=0.5
    )
    assert time.perf_counter() - started < 8
    assert data.train_y.shape == (1, 20_000) and data.train_x.shape == (1, 20_000)


# --- 3. COCO: sizes, bombs, duplicate ids, paths outside the folder, FIFOs ------------------------


def _coco_label_matrix(folder: Path) -> list[Path]:
    # 20,000 images x 20,000 categories (1 MB of JSON): a 400 MB label matrix before the check
    paths = write_coco(folder)
    document = {
        "images": [{"id": i, "file_name": "x"} for i in range(20_000)],
        "annotations": [],
        "categories": [{"id": i, "name": ""} for i in range(20_000)],
    }
    paths["train2014"].write_text(json.dumps(document))
    return []


def _coco_png_bomb(folder: Path) -> list[Path]:
    write_coco(folder)  # a 30,000 x 30,000 PNG header: PIL's DecompressionBombError escaped
    (folder / "train2014" / "COCO_000000000001.jpg").write_bytes(png_bytes(30_000, 30_000, 1))
    return []


def _coco_duplicate_category(folder: Path) -> list[Path]:
    paths = write_coco(folder)
    for split, ids in (("train2014", [1, 2]), ("val2014", [3])):
        document = coco_document(ids)
        document["categories"].append({"id": 2, "name": "bicycle"})  # accepted: which is 2?
        paths[split].write_text(json.dumps(document))
    return []


def _coco_outside_root(folder: Path) -> list[Path]:
    from PIL import Image

    paths = write_coco(folder)
    Image.new("RGB", (4, 4)).save(folder / "secret.png")
    document = coco_document([1, 2])
    document["images"][0]["file_name"] = "../secret.png"  # was read from outside train2014/
    paths["train2014"].write_text(json.dumps(document))
    return []


def _coco_image_fifo(folder: Path) -> list[Path]:
    write_coco(folder)
    return [fifo(folder / "train2014" / "COCO_000000000002.jpg")]  # the loader blocked


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (_coco_label_matrix, r"20000 images x 20000 categories is too large a label matrix"),
        (_coco_png_bomb, r"cannot read COCO image .*COCO_000000000001\.jpg: DecompressionBomb"),
        (_coco_duplicate_category, r"field 'categories\[\]\.id' = 2 is listed twice"),
        (_coco_outside_root, r"file_name '\.\./secret\.png' is not a file name inside"),
        (_coco_image_fifo, r"COCO_000000000002\.jpg is not a regular file but a FIFO"),
    ],
    ids=["label-matrix-size", "png-bomb", "duplicate-category-id", "outside-root", "fifo"],
)
def test_3_coco_sizes_bombs_duplicates_paths_and_fifos_are_refused(tmp_path, build, match):
    fifos = build(tmp_path)
    _raises_quickly(lambda: load_coco(tmp_path), fifos, match)


# --- 4. LEAF / FEMNIST: FIFOs refused; each image's shape checked exactly -------------------------


def test_4_leaf_fifo_and_nested_pixel_lists_are_refused(tmp_path):
    write_femnist(tmp_path)
    pipe = fifo(tmp_path / "test" / "t.json")
    _raises_quickly(lambda: load_femnist(tmp_path), [pipe], r"t\.json is not a regular file")
    # rows of 784 lists of 784 numbers passed the length check, and 2 such rows loaded as 1,568
    # images for 2 labels
    other = tmp_path / "nested"
    other.mkdir()
    row = [[0.5] * 784] * 784
    document = {"users": ["w0"], "user_data": {"w0": {"x": [row, row], "y": [1, 2]}}}
    write_femnist(other).write_text(json.dumps(document))
    with pytest.raises(DataError, match=r"x\[0\] holds lists, expected 784 numbers"):
        load_femnist(other)


# --- 5. XC files: ASCII digits, 32-bit ids, header counts bounded by what can be held -----------


@pytest.mark.parametrize(
    ("train", "loader", "match"),
    [
        ("3 \u00b2 4\n", "extreme_classification", r"train\.txt, line 1: bad header '3 ² 4'"),
        (  # ids >= 2**31 passed the range check and wrapped around in int32
            "1 4294967296 4\n0 3000000000:1\n",
            "extreme_classification",
            r"line 1: header says 4294967296 features; at most 2147483647",
        ),
        (  # the dense multi-hot targets: points x 10**12 labels, a MemoryError
            "1 6 1000000000000\n0 1:1\n",
            "xc_multilabel",
            r"line 1: header says 1000000000000 labels",
        ),
        (  # int() refuses more than 4,300 digits: a ValueError
            "1 6 4\n" + "7" * 5000 + " 1:1\n",
            "extreme_classification",
            r"line 2: label id 7{30}\.\.\. is out of range \[0, 4\)",
        ),
    ],
    ids=["superscript-digit", "id-beyond-int32", "1e12-labels", "5000-digit-label"],
)
def test_5_xc_header_and_ids_are_checked_before_allocating(tmp_path, train, loader, match):
    write_xc(tmp_path)
    (tmp_path / "train.txt").write_text(train)
    (tmp_path / "test.txt").write_text(train.splitlines()[0] + "\n0 1:1\n")
    with pytest.raises(DataError, match=match):
        load_xc(tmp_path, loader)


# --- 6. the split cache is checked against the dataset it is used for ---------------------------


def test_6_split_cache_with_negative_ids_or_other_clients_is_refused(tmp_path):
    path = cached_split_file(tmp_path)  # a digits run: 1,347 training rows, 10 clients
    ids = np.arange(1347, dtype=np.int64)
    ids[5] = -1  # would silently index from the end: another sample trained on
    write_split_table(path, ids, np.linspace(0, 1347, 11).astype(np.int64))
    with pytest.raises(DataError, match=r"split_\w+\.parquet holds row id -1, outside \[0, 1347\)"):
        split_again(tmp_path)
    write_split_table(path, np.arange(1347), np.array([0, 700, 1347]))
    with pytest.raises(DataError, match=r"holds 2 clients, not the 10 expected"):
        split_again(tmp_path)


# --- 8. every reader refuses non-regular files before opening them -------------------------------


def _arff_reader(folder: Path) -> tuple[Callable[[], object], Path]:
    return (lambda: arff.read_arff(str(folder / "x.arff"))), folder / "x.arff"


def _mulan_xml_reader(folder: Path) -> tuple[Callable[[], object], Path]:
    return (lambda: arff.read_mulan_labels(str(folder / "l.xml"))), folder / "l.xml"


def _coco_json_reader(folder: Path) -> tuple[Callable[[], object], Path]:
    path = folder / "instances.json"
    return (lambda: coco.read_coco_annotations(str(path))), path


def _xc_reader(folder: Path) -> tuple[Callable[[], object], Path]:
    from raysim.data.xml import parse_xc_file

    return (lambda: parse_xc_file(folder / "train.txt")), folder / "train.txt"


def _split_cache_reader(folder: Path) -> tuple[Callable[[], object], Path]:
    from raysim.data.store import load_split

    return (lambda: load_split(folder / "split.parquet")), folder / "split.parquet"


def _cifar_reader(folder: Path) -> tuple[Callable[[], object], Path]:
    directory = write_cifar10(folder)
    return (lambda: load_cifar10(folder)), directory / "data_batch_2"


READERS = [_arff_reader, _mulan_xml_reader, _coco_json_reader, _xc_reader, _split_cache_reader]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("reader", [*READERS, _cifar_reader], ids=lambda r: r.__name__.strip("_"))
def test_8_every_reader_refuses_fifos_and_folders_before_opening(tmp_path, reader, kind):
    load, path = reader(tmp_path)
    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        fifos = [path]
    else:
        path.mkdir()
        fifos = []
    expected = "a FIFO" if kind == "fifo" else "a directory"
    _raises_quickly(load, fifos, rf"{path.name} is not a regular file but {expected}")
