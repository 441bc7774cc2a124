"""Dataset loaders: embedded defaults that need no download, and readers of files users have.

Every loader returns a `Dataset` of plain numpy arrays (float32 features, int64 labels), because
the engine puts those arrays in the Ray object store once per run and clients slice them by index.
No loader ever downloads anything: real datasets are read from `data.root` in the layout their
usual tool writes (torchvision, LEAF), and a missing or malformed file is a `DataError` that names
the file and says how to obtain or fix it.

Loader signature: `load_<name>(root, seed, *, options)`. The keyword-only options are the keys a
config may set under `data:` (see `raysim.registry`).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import operator
import os
import pickle
import stat
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim.data import torchvision_adapter as tv
from raysim.errors import ConfigError, DataError


@dataclass(frozen=True)
class Dataset:
    """Train/test arrays of one dataset, ready to be shared read-only by every client."""

    name: str
    train_x: np.ndarray  # float32, C-contiguous, shape (n_train, *sample_shape)
    train_y: np.ndarray  # int64, shape (n_train,)
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    # int64 (n_train,): natural client (e.g. FEMNIST writer) of each train sample; None if none.
    train_groups: np.ndarray | None = None
    # Sparse bag-of-words inputs (Extreme Classification data): train_x/test_x are int32
    # (n, max_features_per_point) feature ids padded with `num_features` (an id no feature
    # has), and the model embeds ids 0..num_features-1. None for dense inputs.
    num_features: int | None = None
    # Multi-label sources with many labels (XML): every true label of each train point, int64
    # (n_train, max_labels) padded with -1, while train_y holds the one positive sampled per
    # point (FedAwS's multi-label -> multi-class step). test_y then has the same padded form.
    train_label_sets: np.ndarray | None = None
    # The validation split (`data.validation_fraction`): rows held out of the training source
    # before the client split, labels in test_y's form. None: no validation split.
    val_x: np.ndarray | None = None
    val_y: np.ndarray | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. (1, 28, 28); what a model factory needs to size its input."""
        return tuple(self.train_x.shape[1:])


# --- option checks ------------------------------------------------------------------------------


def _int_option(key: str, value: Any, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"'data.{key}' must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"'data.{key}' must be >= {minimum}, got {number}")
    return number


# The most feature values a synthetic generator makes: 2^30 float32 values are 4 GiB (the
# largest built-in setting, 4,000,000 x 16 samples, is 2^26). A config asking for more is a
# typo that would otherwise end in a MemoryError after minutes of drawing.
GENERATED_VALUES_LIMIT = 2**30


def _generated_size(what: str, values: int, lower: str = "data.num_samples") -> None:
    """Refuse a synthetic dataset of more than GENERATED_VALUES_LIMIT values (one line)."""
    if values > GENERATED_VALUES_LIMIT:
        raise ConfigError(
            f"{what} asks for {values:,} feature values, more than {GENERATED_VALUES_LIMIT:,} "
            f"(4 GiB of float32); lower {lower}"
        )


def _float_option(key: str, value: Any, *, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ConfigError(f"'data.{key}' must be a number, got {value!r}")
    number = float(value)
    if not np.isfinite(number) or number < minimum or (strict and number == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ConfigError(f"'data.{key}' must be a finite number {bound}, got {value!r}")
    return number


def _shape_option(key: str, value: Any) -> tuple[int, ...]:
    values = (
        [value] if isinstance(value, int | np.integer) and not isinstance(value, bool) else value
    )
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) == 0:
        raise ConfigError(f"'data.{key}' must be a list of positive integers, got {value!r}")
    shape = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int | np.integer) or item < 1:
            raise ConfigError(f"'data.{key}' must be a list of positive integers, got {value!r}")
        shape.append(int(item))
    return tuple(shape)


# --- reading data files -------------------------------------------------------------------------
#
# Every reader opens its files through `open_regular_file` (or `read_regular_file`): a FIFO, a
# device or a directory where a data file is expected would block the reader forever or stream
# without end, so only regular files are opened, and each format has a size bound, checked
# before a byte is read, so that a sparse or absurd file is refused instead of filling memory.
# The readers then check each header against what the file can hold before they allocate.

_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _regular_file_problem(path: str, what: str, info: os.stat_result) -> DataError | None:
    if stat.S_ISREG(info.st_mode):
        return None
    kind = _FILE_KINDS.get(stat.S_IFMT(info.st_mode), "another kind of file")
    return DataError(f"{path} is not a regular file but {kind} (expected the {what})")


def open_regular_file(
    path: str | os.PathLike, what: str, max_bytes: int | None, *, missing: str | None = None
) -> tuple[Any, int]:
    """(binary handle, size) of `path` if it is a regular file of at most `max_bytes` bytes.

    Anything else is one DataError naming the path: `missing` (or "<what> not found: <path>")
    when it does not exist. The path is checked with stat before it is opened (so a device is
    never opened), then opened non-blocking (a FIFO swapped in meanwhile cannot block the open)
    and checked again on the open descriptor, which is the file that will be read.
    """
    path = os.fspath(path)
    try:
        problem = _regular_file_problem(path, what, os.stat(path))
        if problem is not None:
            raise problem
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DataError(missing or f"{what} not found: {path}") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise DataError(f"cannot read {what} {path}: {reason}") from None
    try:
        info = os.fstat(fd)
        problem = _regular_file_problem(path, what, info)
        if problem is not None:
            raise problem
        if max_bytes is not None and info.st_size > max_bytes:
            raise DataError(
                f"{path}: {info.st_size:,} bytes is more than a {what} may have "
                f"({max_bytes:,} bytes); is this the right file?"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(
    path: str | os.PathLike, what: str, max_bytes: int, *, missing: str | None = None
) -> bytes:
    """The content of a regular file of at most `max_bytes` bytes (see `open_regular_file`)."""
    handle, size = open_regular_file(path, what, max_bytes, missing=missing)
    try:
        with handle:
            # read(n) allocates n bytes up front: ask for the size stat gave (one more byte
            # tells a file that grew meanwhile), never for the bound.
            content = handle.read(size + 1)
    except OSError as error:
        raise DataError(f"cannot read {what} {os.fspath(path)}: {error}") from None
    if len(content) > size:
        raise DataError(f"{os.fspath(path)}: the {what} changed while it was read")
    return content


def path_under(folder: str, name: str, what: str, source: str) -> str:
    """`folder/name` for a file name read from a data file (`source`), refused when it is
    absolute or climbs out of `folder` with '..': a data file names files in its own folder
    and must not make raysim read others. Symbolic links inside the folder are followed (a
    user may link a dataset in from elsewhere); containment is checked on the path as written.
    """
    base = os.path.normpath(folder)
    path = os.path.normpath(os.path.join(base, name))
    if os.path.isabs(name) or os.path.commonpath([base, path]) != base or path == base:
        raise DataError(
            f"{source}: {what} {name[:200]!r} is not a file name inside {folder} (absolute "
            f"paths and '..' are refused)"
        )
    return path


def ascii_uint(text: str) -> int | None:
    """The value of `text` if it is ASCII digits only, else None. str.isdigit alone accepts
    digits such as '²' that int() refuses; beyond 18 digits (more than any count or id a data
    file may hold) the value is clamped to 10**18, since int() refuses more than 4,300 digits
    and each digit would cost time. Callers print `text` itself in their messages."""
    if not text or not (text.isascii() and text.isdigit()):
        return None
    return int(text) if len(text) <= 18 else 10**18


def _how_to_obtain(name: str, root: str) -> str:
    return _FEMNIST_HOW if name == "femnist" else tv.how_to_obtain(name, root)


def _require_root(root: str | None, name: str, expected: str) -> str:
    if root is None:
        raise DataError(
            f"'data.root' must be set for dataset '{name}' (the folder containing {expected}); "
            f"{_how_to_obtain(name, '<data.root>')}"
        )
    if not os.path.isdir(root):
        raise DataError(
            f"dataset '{name}': data.root {root!r} is not a directory (expected a "
            f"folder containing {expected}); {_how_to_obtain(name, root)}"
        )
    return root


def _normalise(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 NCHW -> float32 scaled to [0, 1] then standardised per channel, without float64."""
    x = images.astype(np.float32)
    x *= np.float32(1.0 / 255.0)
    channel_shape = (1, len(mean)) + (1,) * (x.ndim - 2)
    x -= np.asarray(mean, dtype=np.float32).reshape(channel_shape)
    x /= np.asarray(std, dtype=np.float32).reshape(channel_shape)
    return np.ascontiguousarray(x)


# --- embedded defaults --------------------------------------------------------------------------


def load_digits(root: str | None, seed: int, *, test_fraction: float = 0.25) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 samples): a real dataset that needs no download.

    The train/test split is fixed (random_state=0, not `seed`) so every run, whatever its seed,
    is evaluated on the same test set and results are comparable.
    """
    from sklearn.datasets import load_digits as sklearn_load_digits
    from sklearn.model_selection import train_test_split

    del root, seed  # bundled data; the split is deliberately independent of the run seed
    fraction = _float_option("test_fraction", test_fraction, minimum=0.0, strict=True)
    if fraction >= 1.0:
        raise ConfigError(f"'data.test_fraction' must be in (0, 1), got {test_fraction!r}")
    bunch = sklearn_load_digits()
    x = bunch.data.astype(np.float64)
    y = bunch.target.astype(np.int64)
    try:
        train_x, test_x, train_y, test_y = train_test_split(
            x, y, test_size=fraction, stratify=y, random_state=0
        )
    except ValueError as error:
        raise ConfigError(
            f"'data.test_fraction'={test_fraction!r} is too extreme for the 1,797 digits ({error})"
        ) from None
    mean = train_x.mean(axis=0)
    std = train_x.std(axis=0)
    std[std == 0] = 1.0  # constant border pixels: centre them, do not divide by zero
    return Dataset(
        name="digits",
        train_x=np.ascontiguousarray((train_x - mean) / std, dtype=np.float32),
        train_y=np.ascontiguousarray(train_y, dtype=np.int64),
        test_x=np.ascontiguousarray((test_x - mean) / std, dtype=np.float32),
        test_y=np.ascontiguousarray(test_y, dtype=np.int64),
        num_classes=10,
    )


def load_synthetic_classification(
    root: str | None,
    seed: int,
    *,
    num_samples: int = 10000,
    num_test: int = 2000,
    num_classes: int = 10,
    sample_shape: Sequence[int] = (32,),
    class_separation: float = 1.0,
    noise: float = 1.0,
) -> Dataset:
    """Learnable synthetic data of any size and sample shape, drawn from `seed`.

    Each class has a mean pattern (every coordinate ~ N(0, class_separation^2)); a sample is its
    class's pattern plus N(0, noise^2) noise. Labels are balanced. Everything is generated in
    float32 and in place, so 4,000,000 x 16 samples cost 256 MB and no float64 copy.
    """
    del root
    num_samples = _int_option("num_samples", num_samples, 1)
    num_test = _int_option("num_test", num_test, 1)
    num_classes = _int_option("num_classes", num_classes, 2)
    shape = _shape_option("sample_shape", sample_shape)
    class_separation = _float_option("class_separation", class_separation, minimum=0.0)
    noise = _float_option("noise", noise, minimum=0.0)
    _generated_size(
        "data synthetic_classification",
        (num_samples + num_test) * math.prod(shape),
        "data.num_samples, data.num_test or data.sample_shape",
    )

    rng = np.random.default_rng(seed)
    patterns = rng.standard_normal((num_classes, *shape), dtype=np.float32)
    patterns *= np.float32(class_separation)

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.arange(count, dtype=np.int64) % num_classes
        rng.shuffle(labels)
        x = rng.standard_normal((count, *shape), dtype=np.float32)
        x *= np.float32(noise)
        chunk = max(1, (1 << 22) // max(1, int(np.prod(shape))))  # ~16 MB of patterns at a time
        for start in range(0, count, chunk):
            x[start : start + chunk] += patterns[labels[start : start + chunk]]
        return x, labels

    train_x, train_y = draw(num_samples)
    test_x, test_y = draw(num_test)
    return Dataset("synthetic_classification", train_x, train_y, test_x, test_y, num_classes)


# --- MNIST (torchvision layout, idx files) ------------------------------------------------------


def _find_file(directory: str, filename: str, name: str, root: str, how: str | None = None) -> str:
    """`filename` or `filename.gz` in `directory`; `how`: how to obtain it (default: the
    torchvision layout's advice for `name`)."""
    candidates = [os.path.join(directory, file) for file in (filename, filename + ".gz")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    for path in candidates:
        if os.path.lexists(path):  # a FIFO, folder, ... there: the reader refuses it by name
            return path
    raise DataError(
        f"dataset '{name}': file not found: {os.path.join(directory, filename)} (or .gz); "
        f"{how or tv.how_to_obtain(name, root)}"
    )


# deflate cannot expand data more than ~1032x; a .gz whose header promises more is a lie
_GZIP_MAX_RATIO = 1100


def _read_idx(path: str, expected_dims: int) -> np.ndarray:
    """Read an idx file (the MNIST format: big-endian header, then unsigned bytes).

    The header is checked before the data is read, and the data size it promises against the
    file (or, for .gz, what its compressed size can hold), so a hostile or broken file costs
    at most the memory its true contents need."""
    raw_handle, file_size = open_regular_file(path, "idx file", None)
    try:
        with (
            gzip.GzipFile(fileobj=raw_handle, mode="rb") if path.endswith(".gz") else raw_handle
        ) as handle:
            head = handle.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0:
                raise DataError(
                    f"{path} is not an idx file (bad magic number; truncated or corrupted?)"
                )
            if head[2] != 0x08:
                raise DataError(
                    f"{path}: idx data type 0x{head[2]:02x} is not unsigned byte (0x08)"
                )
            dims = head[3]
            if dims != expected_dims:
                raise DataError(f"{path}: idx file has {dims} dimensions, expected {expected_dims}")
            sizes = handle.read(4 * dims)
            if len(sizes) < 4 * dims:
                raise DataError(f"{path}: truncated idx header")
            shape = tuple(int.from_bytes(sizes[4 * i : 4 * i + 4], "big") for i in range(dims))
            payload = math.prod(shape)  # exact: np.prod would wrap around for huge shapes
            header = 4 + 4 * dims
            limit = file_size * _GZIP_MAX_RATIO if path.endswith(".gz") else file_size
            if header + payload > limit:
                raise DataError(
                    f"{path}: idx header says shape {shape} ({header + payload} bytes in all) "
                    f"but the file has {file_size} bytes (truncated or corrupted?)"
                )
            raw = handle.read(payload + 1)  # one more: a longer file is caught too
    except (OSError, EOFError, zlib.error) as error:  # zlib.error: a corrupted .gz stream
        raise DataError(f"cannot read {path}: {error} (truncated or corrupted?)") from None
    finally:
        raw_handle.close()
    if len(raw) != payload:
        size = header + len(raw) if len(raw) <= payload else "more than that"
        raise DataError(
            f"{path}: idx header says shape {shape} ({header + payload} bytes in all) but the "
            f"file has {size} bytes (truncated or corrupted?)"
        )
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def read_idx_images(image_path: str, label_path: str) -> tuple[np.ndarray, np.ndarray]:
    """28x28 uint8 images and their int64 labels from a pair of idx files (MNIST's format),
    checked to match."""
    images = _read_idx(image_path, 3)
    labels = _read_idx(label_path, 1).astype(np.int64)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{image_path}: images are {images.shape[1:]}, expected 28x28")
    if len(images) != len(labels):
        raise DataError(
            f"{image_path} has {len(images)} images but {label_path} has {len(labels)} labels"
        )
    return images, labels


def _load_mnist_split(directory: str, split: str, root: str) -> tuple[np.ndarray, np.ndarray]:
    image_name, label_name = tv.MNIST_FILES[split]
    image_path = _find_file(directory, image_name, "mnist", root)
    label_path = _find_file(directory, label_name, "mnist", root)
    images, labels = read_idx_images(image_path, label_path)
    if len(labels) and labels.max() > 9:
        raise DataError(f"{label_path}: label {labels.max()} is out of range [0, 10)")
    x = _normalise(images[:, None, :, :], tv.MNIST_MEAN, tv.MNIST_STD)
    return x, labels


def load_mnist(root: str | None, seed: int) -> Dataset:
    """MNIST from `root/MNIST/raw/*-ubyte[.gz]` (torchvision's layout), NCHW (1, 28, 28)."""
    del seed
    root = _require_root(root, "mnist", tv.MNIST_RAW_DIR)
    directory = os.path.join(root, tv.MNIST_RAW_DIR)
    train_x, train_y = _load_mnist_split(directory, "train", root)
    test_x, test_y = _load_mnist_split(directory, "test", root)
    return Dataset("mnist", train_x, train_y, test_x, test_y, num_classes=10)


# --- CIFAR (torchvision layout, python pickle batches) ------------------------------------------

# A CIFAR python batch is a few dozen MB (CIFAR-100's train file, re-pickled by Python 3 with
# protocol 2, about 230 MB); a file far larger is not one, and is refused before it is read.
_CIFAR_MAX_BYTES = 1 << 30
# What the allowed constructors may build, in bytes per byte of the file (plus 1 MiB): a real
# batch builds each array once, from bytes the file holds (twice with Python 3's protocol-2
# round trip through latin1 text). More means the pickle multiplies what it holds - e.g.
# `_codecs.encode(..., 'hex')` nested doubles its input each time: 1.6 KB -> 3.6 GB.
_CIFAR_BUILD_RATIO = 4
_CIFAR_BUILD_SLACK = 1 << 20
_LATIN1_NAMES = {"latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "iso8859_1", "l1"}


class _NdarrayClass:
    """Stands for numpy.ndarray in a pickle, where it is only ever the first argument of
    `_reconstruct`: the class itself is not handed out, so no opcode can call it or its
    __new__ with a shape of the pickle's choosing."""


_NDARRAY = _NdarrayClass()


def _simple_dtype(dtype: Any) -> bool:
    """A plain numeric dtype (no objects, fields or sub-arrays): all a CIFAR batch has, and the
    only kind whose arrays numpy builds from raw bytes alone (object arrays can crash it)."""
    return (
        isinstance(dtype, np.dtype)
        and dtype.kind in "biufc"
        and not dtype.hasobject
        and dtype.fields is None
        and dtype.subdtype is None
    )


class _RestrictedUnpickler(pickle._Unpickler):
    """Unpickler that can build dicts, lists, bytes and numpy arrays - and nothing else - and no
    more of them than the file holds.

    A pickle can run arbitrary code when loaded; a CIFAR batch only needs a few globals, so
    anything else (e.g. os.system) means the file is not what it claims and is refused. The
    globals it may use are not the real ones but checked stand-ins that charge what they build
    to a budget derived from the file size, and the BUILD opcode (which sets an object's state)
    accepts only what numpy pickles write for a plain array or dtype. It is the pure-Python
    unpickler because only that one lets BUILD be checked; a batch has few opcodes (its pixels
    are one string), so it is as fast here.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, path: str, file_size: int) -> None:
        super().__init__(file, encoding="bytes")
        self.path = path
        self.budget = _CIFAR_BUILD_RATIO * file_size + _CIFAR_BUILD_SLACK
        self.file_size = file_size
        self.built = 0
        self.safe_globals: dict[tuple[str, str], Any] = {
            ("_codecs", "encode"): self._encode,
            ("numpy", "ndarray"): _NDARRAY,
            ("numpy", "dtype"): self._dtype,
        }
        for module in ("builtins", "__builtin__"):  # Python 2 names appear in the originals
            self.safe_globals.update(
                {
                    (module, "bytes"): self._bytes,
                    (module, "str"): self._str,
                    (module, "list"): self._list,
                    (module, "dict"): self._dict,
                }
            )
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            self.safe_globals[(module, "_reconstruct")] = self._reconstruct
            self.safe_globals[(module, "scalar")] = self._scalar

    def find_class(self, module: str, name: str) -> Any:
        found = self.safe_globals.get((module, name))
        if found is None:
            raise DataError(
                f"refusing to load {self.path}: it references {str(module)[:80]}."
                f"{str(name)[:80]}, which a CIFAR batch never contains (only dict, list, bytes, "
                f"str and numpy arrays are allowed)"
            )
        return found

    def _refuse(self, what: str) -> DataError:
        return DataError(
            f"refusing to load {self.path}: it calls {what}, which a CIFAR batch never does"
        )

    def _charge(self, nbytes: int) -> None:
        """Count `nbytes` about to be built; refuse before building past the budget."""
        self.built += nbytes
        if self.built > self.budget:
            raise DataError(
                f"refusing to load {self.path}: it builds more than {self.budget:,} bytes of "
                f"objects from {self.file_size:,} bytes of file (a CIFAR batch holds its arrays "
                f"in the file; this one multiplies them: a pickle bomb?)"
            )

    # -- the stand-ins for the allowed globals ---------------------------------------------

    def _encode(self, text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
        # Python 3 pickles bytes for protocol < 3 as _codecs.encode(latin1 text, 'latin1'):
        # one byte per character. Other codecs grow their input (hex doubles it) or do more.
        if not (
            isinstance(text, str)
            and isinstance(encoding, str)
            and encoding.lower() in _LATIN1_NAMES
            and isinstance(errors, str)
        ):
            shown = encoding[:40] if isinstance(encoding, str) else type(encoding).__name__
            raise self._refuse(
                f"_codecs.encode({type(text).__name__}, {shown!r}) (only latin1 text to bytes)"
            )
        self._charge(len(text))
        return text.encode("latin-1", errors)

    def _bytes(self, *args: Any) -> bytes:
        if not args:  # how protocol < 3 pickles b''
            return b""
        if len(args) == 1 and isinstance(args[0], bytes | bytearray):
            self._charge(len(args[0]))
            return bytes(args[0])
        raise self._refuse(f"bytes({', '.join(type(a).__name__ for a in args[:3])})")

    def _str(self, *args: Any) -> str:
        if not args:
            return ""
        if len(args) == 1 and isinstance(args[0], str):
            return args[0]
        raise self._refuse(f"str({', '.join(type(a).__name__ for a in args[:3])})")

    def _list(self, *args: Any) -> list:
        if not args:
            return []
        if len(args) == 1 and isinstance(args[0], list | tuple):
            self._charge(8 * len(args[0]))
            return list(args[0])
        raise self._refuse(f"list({', '.join(type(a).__name__ for a in args[:3])})")

    def _dict(self, *args: Any) -> dict:
        if not args:
            return {}
        if len(args) == 1 and isinstance(args[0], dict | list | tuple):
            self._charge(64 * len(args[0]))
            return dict(args[0])
        raise self._refuse(f"dict({', '.join(type(a).__name__ for a in args[:3])})")

    def _checked_dtype(self, spec: Any, *args: Any) -> np.dtype:
        if not isinstance(spec, str | bytes | np.dtype):
            raise self._refuse(f"numpy.dtype({type(spec).__name__})")
        dtype = np.dtype(spec, *args)
        if not _simple_dtype(dtype):
            raise self._refuse(f"numpy.dtype({str(dtype)[:40]!r}) (only plain numeric dtypes)")
        return dtype

    def _dtype(self, spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
        return self._checked_dtype(spec, bool(align), bool(copy))

    def _shape(self, shape: Any) -> tuple[int, ...]:
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, tuple | list) or len(shape) > 32:
            raise self._refuse(f"an array of shape {type(shape).__name__}")
        for size in shape:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise self._refuse(f"an array of shape {str(shape)[:60]}")
        return tuple(shape)

    def _reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
        if subtype is not _NDARRAY:
            raise self._refuse(f"_reconstruct({type(subtype).__name__}, ...)")
        shape = self._shape(shape)
        dtype = self._checked_dtype(dtype)
        self._charge(math.prod(shape) * dtype.itemsize)  # exact: before numpy allocates
        return np.empty(shape, dtype=dtype)

    def _scalar(self, dtype: Any, data: Any = None) -> Any:
        if not (_simple_dtype(dtype) and isinstance(data, bytes) and len(data) == dtype.itemsize):
            raise self._refuse("numpy scalar() with anything but a plain dtype and its bytes")
        self._charge(len(data))
        return np.frombuffer(data, dtype=dtype)[0]

    # -- BUILD: only the state numpy pickles write for a plain array or dtype --------------

    def _load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if isinstance(target, np.ndarray) and type(target) is np.ndarray:
            self._build_array(target, state)
        elif isinstance(target, np.dtype) and _simple_dtype(target):
            # (version, byte order, subarray, names, fields, itemsize, alignment, flags[, meta])
            if (
                not isinstance(state, tuple)
                or len(state) not in (8, 9)
                or any(part is not None for part in state[2:5])
            ):
                raise self._refuse("numpy.dtype.__setstate__ with fields or sub-arrays")
            target.__setstate__(state)
        else:
            raise self._refuse(f"the BUILD of a {type(target).__name__}")

    def _build_array(self, array: np.ndarray, state: Any) -> None:
        # (version, shape, dtype, is_fortran, raw bytes); version is absent in old pickles
        if isinstance(state, tuple) and len(state) == 5:
            parts = state[1:]
        elif isinstance(state, tuple) and len(state) == 4:
            parts = state
        else:
            raise self._refuse("numpy.ndarray.__setstate__ with a state numpy never writes")
        shape, dtype, _, raw = parts
        shape = self._shape(shape)
        if not _simple_dtype(dtype):
            raise self._refuse(f"numpy.ndarray.__setstate__ with dtype {str(dtype)[:40]!r}")
        if not isinstance(raw, bytes) or len(raw) != math.prod(shape) * dtype.itemsize:
            raise DataError(
                f"{self.path}: an array's data does not match its shape {shape[:8]} and dtype "
                f"{dtype} (truncated or corrupted?)"
            )
        self._charge(len(raw))  # numpy may copy it (unaligned or byte-swapped data)
        array.__setstate__(state)

    def _load_by_class(self) -> None:
        # Instances made by calling a class (NEWOBJ and kin) never occur in a batch: arrays,
        # dtypes and scalars come from the functions above, containers from their opcodes.
        raise self._refuse("a class to make an object (pickle opcode NEWOBJ, OBJ or INST)")

    dispatch[pickle.BUILD[0]] = _load_build
    dispatch.update(
        dict.fromkeys(
            (pickle.NEWOBJ[0], pickle.NEWOBJ_EX[0], pickle.OBJ[0], pickle.INST[0]), _load_by_class
        )
    )


def _read_cifar_batch(path: str, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    content = read_regular_file(path, "CIFAR python batch", _CIFAR_MAX_BYTES)
    try:
        # From memory: a length in the pickle larger than the file then costs nothing.
        batch = _RestrictedUnpickler(io.BytesIO(content), path, len(content)).load()
    except DataError:
        raise
    except Exception as error:  # any unpickling failure means a truncated or foreign file
        raise DataError(
            f"{path} is not a readable CIFAR python batch (truncated or corrupted?): "
            f"{type(error).__name__}: {str(error)[:200]}"
        ) from None
    finally:
        del content
    if not isinstance(batch, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    batch = {
        key.decode("latin1") if isinstance(key, bytes) else key: value
        for key, value in batch.items()
    }
    for key in ("data", label_key):
        if key not in batch:
            raise DataError(f"{path}: missing key b'{key}' (found {sorted(map(str, batch))})")
    data = batch["data"]
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
    ):
        description = (
            f"{data.dtype} array of shape {data.shape}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise DataError(
            f"{path}: b'data' must be a uint8 array of shape (n, 3072), got {description}"
        )
    labels = batch[label_key]
    if isinstance(labels, np.ndarray) and labels.dtype.kind in "iu":
        labels = labels.tolist()
    if not isinstance(labels, list) or not all(
        isinstance(label, int) and not isinstance(label, bool) for label in labels
    ):
        raise DataError(f"{path}: b'{label_key}' must be a list of integers")
    for label in labels:  # before the int64 conversion, which would overflow on huge values
        if not 0 <= label < num_classes:
            raise DataError(f"{path}: label {label} is out of range [0, {num_classes})")
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (len(data),):
        raise DataError(f"{path}: {len(data)} images but b'{label_key}' has shape {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _load_cifar(
    root: str | None,
    name: str,
    folder: str,
    files: tuple[tuple[str, ...], ...],
    label_key: str,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> Dataset:
    root = _require_root(root, name, folder + "/")
    directory = os.path.join(root, folder)
    arrays = []
    for split_files in files:
        images, labels = [], []
        for filename in split_files:
            path = os.path.join(directory, filename)
            if not os.path.lexists(path):  # a FIFO or folder there is refused by the reader
                raise DataError(
                    f"dataset '{name}': file not found: {path}; {tv.how_to_obtain(name, root)}"
                )
            batch_images, batch_labels = _read_cifar_batch(path, label_key, num_classes)
            images.append(batch_images)
            labels.append(batch_labels)
        arrays.append((_normalise(np.concatenate(images), mean, std), np.concatenate(labels)))
    (train_x, train_y), (test_x, test_y) = arrays
    return Dataset(name, train_x, train_y, test_x, test_y, num_classes)


def load_cifar10(root: str | None, seed: int) -> Dataset:
    """CIFAR-10 from `root/cifar-10-batches-py/` (torchvision's layout), NCHW (3, 32, 32)."""
    del seed
    return _load_cifar(
        root,
        "cifar10",
        tv.CIFAR10_DIR,
        (tv.CIFAR10_TRAIN_FILES, tv.CIFAR10_TEST_FILES),
        "labels",
        10,
        tv.CIFAR10_MEAN,
        tv.CIFAR10_STD,
    )


def load_cifar100(root: str | None, seed: int) -> Dataset:
    """CIFAR-100 (fine labels) from `root/cifar-100-python/` (torchvision's layout)."""
    del seed
    return _load_cifar(
        root,
        "cifar100",
        tv.CIFAR100_DIR,
        (tv.CIFAR100_TRAIN_FILES, tv.CIFAR100_TEST_FILES),
        "fine_labels",
        100,
        tv.CIFAR100_MEAN,
        tv.CIFAR100_STD,
    )


# --- FEMNIST (LEAF json) ------------------------------------------------------------------------

FEMNIST_CLASSES = 62
_FEMNIST_HOW = (
    "generate it with LEAF (github.com/TalwalkarLab/leaf, data/femnist/preprocess.sh) "
    "on a machine with internet access and copy its data/ folder"
)


def _femnist_files(root: str, split: str) -> list[str]:
    for directory in (os.path.join(root, split), os.path.join(root, "data", split)):
        if os.path.isdir(directory):
            files = sorted(glob.glob(os.path.join(directory, "*.json")))
            if not files:
                raise DataError(
                    f"dataset 'femnist': no *.json files in {directory}; {_FEMNIST_HOW}"
                )
            return files
    raise DataError(
        f"dataset 'femnist': folder not found: {os.path.join(root, split)} (nor "
        f"{os.path.join(root, 'data', split)}); expected LEAF json files in "
        f"<data.root>/train/*.json and <data.root>/test/*.json; {_FEMNIST_HOW}"
    )


# A JSON data file is at most a few hundred MB (COCO 2014's train annotations: 332 MB); Python
# holds a parsed file in several times its size, so a larger one is refused before it is read.
JSON_MAX_BYTES = 2 << 30


def read_json_file(path: str, kind: str) -> Any:
    """A JSON data file, every failure one DataError naming the file (and line, if known)."""
    content = read_regular_file(path, f"{kind} file", JSON_MAX_BYTES)
    try:
        text = content.decode("utf-8")
        del content
        # As text-mode open() would read it: universal newlines (the error's line numbers)
        return json.loads(text.replace("\r\n", "\n").replace("\r", "\n"))
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {kind} {path}: {error}") from None
    except (ValueError, RecursionError) as error:  # an over-long integer; absurd nesting
        raise DataError(f"{path}: not a {kind} file: {error}") from None


def _read_leaf_file(path: str) -> tuple[list[str], dict]:
    content = read_json_file(path, "LEAF json")
    if not isinstance(content, dict):
        raise DataError(f"{path}: expected a JSON object with keys 'users' and 'user_data'")
    for key in ("users", "user_data"):
        if key not in content:
            raise DataError(
                f"{path}: missing key '{key}' (a LEAF file has 'users', "
                f"'num_samples' and 'user_data')"
            )
    users, user_data = content["users"], content["user_data"]
    if not isinstance(users, list) or not isinstance(user_data, dict):
        raise DataError(f"{path}: 'users' must be a list and 'user_data' an object")
    names = [str(user) for user in users]
    seen: set[str] = set()
    for name in names:
        if name in seen:  # the writer's samples would be read twice
            raise DataError(f"{path}: user {name[:60]!r} is listed twice in 'users'")
        seen.add(name)
    return names, user_data


def _leaf_user_arrays(path: str, user: str, user_data: dict) -> tuple[np.ndarray, np.ndarray]:
    where = f"{path}: user_data[{user!r}]"
    record = user_data.get(user)
    if not isinstance(record, dict):
        raise DataError(f"{where} is missing (user listed in 'users' has no data)")
    for key in ("x", "y"):
        if not isinstance(record.get(key), list):
            raise DataError(f"{where}: missing list '{key}'")
    x_rows, y_values = record["x"], record["y"]
    if len(x_rows) != len(y_values):
        raise DataError(f"{where}: len(x) = {len(x_rows)} but len(y) = {len(y_values)}")
    for row_number, row in enumerate(x_rows):
        if not isinstance(row, list) or len(row) != 784:
            length = len(row) if isinstance(row, list) else type(row).__name__
            raise DataError(
                f"{where}: x[{row_number}] has length {length}, expected 784 "
                f"(a flattened 28x28 image)"
            )
    try:
        # Without a dtype first: strings, booleans and None must not be converted silently.
        pixels = np.asarray(x_rows) if x_rows else np.zeros((0, 784), dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        raise DataError(f"{where}: x must contain only numbers") from None
    if pixels.dtype.kind not in "fiu":
        raise DataError(f"{where}: x must contain only numbers")
    if pixels.shape != (len(x_rows), 784):
        # Rows of 784 lists of numbers pass the length check above; reshaped, they would be
        # read as 784 times as many images as there are labels, misaligned with them.
        row_number = next(
            (n for n, row in enumerate(x_rows) if any(isinstance(v, list) for v in row)), 0
        )
        raise DataError(
            f"{where}: x[{row_number}] holds lists, expected 784 numbers (a flattened 28x28 image)"
        )
    with np.errstate(over="ignore"):
        x = pixels.astype(np.float32).reshape(-1, 1, 28, 28)
    if not np.isfinite(x).all():
        raise DataError(f"{where}: x must contain only finite numbers (float32 range)")
    for index, label in enumerate(y_values):
        if isinstance(label, bool) or not isinstance(label, int):
            raise DataError(f"{where}: y must contain only integer labels")
        if not 0 <= label < FEMNIST_CLASSES:
            raise DataError(
                f"{where}: label y[{index}] = {label} is out of range [0, {FEMNIST_CLASSES})"
            )
    return x, np.asarray(y_values, dtype=np.int64)


def _read_leaf_split(
    files: list[str], wanted: set[str] | None, limit: int | None
) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    """Users (in file order) with their arrays: those in `wanted`, or the first `limit` users."""
    users_read: list[str] = []
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for path in files:
        users, user_data = _read_leaf_file(path)
        for user in users:
            if wanted is not None and user not in wanted:
                continue
            if limit is not None and len(users_read) >= limit:
                break
            x, y = _leaf_user_arrays(path, user, user_data)
            users_read.append(user)
            xs.append(x)
            ys.append(y)
        done_wanted = wanted is not None and len(users_read) >= len(wanted)
        if done_wanted or (limit is not None and len(users_read) >= limit):
            break
    return users_read, xs, ys


def load_femnist(root: str | None, seed: int, *, max_writers: int | None = None) -> Dataset:
    """FEMNIST from LEAF json (`root/train/*.json`, `root/test/*.json`): 62 classes, writers.

    `train_groups` holds each train sample's writer (numbered in sorted-file order, then the
    order of 'users'), so the 'natural' partition gives every writer its own client.
    `max_writers` reads only the first writers (for quick runs); the test set is then restricted
    to those writers' test samples (LEAF's default per-writer split), or, if the test files hold
    other writers, to the first `max_writers` test writers.
    """
    del seed
    if max_writers is not None:
        max_writers = _int_option("max_writers", max_writers, 1)
    root = _require_root(root, "femnist", "LEAF's train/ and test/ json folders")
    train_files = _femnist_files(root, "train")
    test_files = _femnist_files(root, "test")

    train_users, train_xs, train_ys = _read_leaf_split(train_files, None, max_writers)
    writer_of: dict[str, int] = {}
    groups = []
    for user, y in zip(train_users, train_ys, strict=True):
        writer = writer_of.setdefault(user, len(writer_of))
        groups.append(np.full(len(y), writer, dtype=np.int64))
    if max_writers is None:
        _, test_xs, test_ys = _read_leaf_split(test_files, None, None)
    else:
        _, test_xs, test_ys = _read_leaf_split(test_files, set(writer_of), None)
        if not test_xs:  # test files hold other writers (LEAF's user-based split)
            _, test_xs, test_ys = _read_leaf_split(test_files, None, max_writers)

    def stack(arrays: list[np.ndarray], empty_shape: tuple[int, ...], dtype: type) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.zeros(empty_shape, dtype=dtype)

    train_y = stack(train_ys, (0,), np.int64)
    if len(train_y) == 0:
        raise DataError(
            f"dataset 'femnist': the train files in {os.path.dirname(train_files[0])} "
            f"hold no samples"
        )
    test_y = stack(test_ys, (0,), np.int64)
    if len(test_y) == 0:
        raise DataError(
            f"dataset 'femnist': the test files in {os.path.dirname(test_files[0])} hold no samples"
        )
    return Dataset(
        name="femnist",
        train_x=stack(train_xs, (0, 1, 28, 28), np.float32),
        train_y=train_y,
        test_x=stack(test_xs, (0, 1, 28, 28), np.float32),
        test_y=test_y,
        num_classes=FEMNIST_CLASSES,
        train_groups=np.concatenate(groups),
    )


def load_dataset(config) -> Dataset:  # config: raysim.config.Config
    """The run's dataset: the `data:` section's plug-in, seeded by the run seed."""
    from raysim import registry
    from raysim.core.sampling import DATA, VALIDATION, purpose_seed

    data = config.data
    dataset = registry.datasets.build(
        data.name, data.root, purpose_seed(config.run.seed, DATA), **data.options
    )
    if data.validation_fraction > 0:
        dataset = carve_validation(
            dataset, data.validation_fraction, purpose_seed(config.run.seed, VALIDATION)
        )
    return dataset


def validation_rows(num_train: int, fraction: float, seed: int) -> np.ndarray:
    """The training rows (sorted) that `carve_validation` holds out: round(fraction x n) of
    them, at least 1, drawn from `seed` alone (so the same for every backend and partitioner)."""
    count = min(num_train - 1, max(1, round(fraction * num_train)))
    if count < 1:
        raise DataError(f"a validation split needs at least 2 training rows, got {num_train}")
    return np.sort(np.random.default_rng(seed).permutation(num_train)[:count])


def carve_validation(dataset: Dataset, fraction: float, seed: int) -> Dataset:
    """`dataset` with `validation_rows` moved out of its training split into val_x/val_y.

    The validation rows leave the training arrays before the client split, so no client ever
    trains on them, and they come from the training source, so they never overlap the test
    split. Labels take the test split's form (an XML dataset's padded label sets)."""
    import dataclasses

    if dataset.val_x is not None:
        raise DataError(f"dataset '{dataset.name}' already has a validation split")
    rows = validation_rows(len(dataset.train_y), fraction, seed)
    keep = np.ones(len(dataset.train_y), dtype=bool)
    keep[rows] = False
    val_y = dataset.train_y[rows]
    if dataset.train_label_sets is not None:  # evaluated like test_y: every true label
        val_y = dataset.train_label_sets[rows]

    def kept(array):
        return None if array is None else np.ascontiguousarray(array[keep])

    return dataclasses.replace(
        dataset,
        train_x=kept(dataset.train_x),
        train_y=kept(dataset.train_y),
        train_groups=kept(dataset.train_groups),
        train_label_sets=kept(dataset.train_label_sets),
        val_x=np.ascontiguousarray(dataset.train_x[rows]),
        val_y=np.ascontiguousarray(val_y),
    )
