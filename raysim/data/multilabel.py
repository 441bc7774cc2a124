"""Multi-label datasets for FLAG: an embedded synthetic default and readers of files users have.

A multi-label `Dataset` holds multi-hot targets: `train_y` and `test_y` are uint8 arrays of shape
(n, L) (1 = the label is present) and `num_classes` is L. Features are float32 as everywhere.

- `synthetic_multilabel` (no download): correlated labels with uneven frequencies and features
  that carry them, any size.
- `arff`: MULAN ARFF files (dense or sparse rows); the label attributes are named by the user or
  taken from MULAN's companion XML file.
- `coco`: MS-COCO 2014 (`annotations/instances_{train,val}2014.json` -> 80-label multi-hot
  vectors, images from `{train,val}2014/` resized like torchvision's Resize + ToTensor +
  Normalize).
- `xc_multilabel`: Extreme Classification Repository text files (via raysim.data.xml, shared
  with FedAwS) as dense multi-hot targets over bag-of-words features.

A malformed file is one `DataError` naming the file and the line (ARFF) or JSON field (COCO).
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from typing import Any

import numpy as np

from raysim.data.datasets import (
    Dataset,
    _float_option,
    _generated_size,
    _int_option,
    ascii_uint,
    open_regular_file,
    path_under,
    read_json_file,
    read_regular_file,
)
from raysim.errors import ConfigError, DataError

# --- synthetic ------------------------------------------------------------------------------------


def load_synthetic_multilabel(
    root: str | None,
    seed: int,
    *,
    num_samples: int = 6000,
    num_test: int = 2000,
    num_labels: int = 20,
    num_features: int = 32,
    num_topics: int = 5,
    max_frequency: float = 0.35,
    min_frequency: float = 0.02,
    frequency_decay: float = 1.0,
    correlation: float = 0.7,
    signal: float = 1.0,
    noise: float = 1.0,
) -> Dataset:
    """Correlated multi-label data with uneven label frequencies and learnable features.

    Labels (a Gaussian copula with topic structure):
      - every label l has a marginal frequency p_l = max(max_frequency * (l + 1)^-decay,
        min_frequency), so label 0 is common and the last labels are rare (COCO-like skew);
      - each sample has `num_topics` latent factors h ~ N(0, I); label l loads on one topic
        with weight sqrt(correlation), z_l = sqrt(correlation) h_topic(l) + sqrt(1 -
        correlation) e_l, and y_l = 1[z_l > Phi^-1(1 - p_l)]. Labels of a topic co-occur,
        which gives k-modes clusters to find (as scenes do in COCO);
      - a sample with no label gets the one whose z is closest to its threshold (every COCO
        image has at least one label).
    Features: x = signal * y M / sqrt(mean labels per sample) + noise * e, with M a fixed
    random (L, num_features) Gaussian matrix: every label is linearly decodable, rare labels are
    harder (fewer examples), and noise sets how hard.
    """
    del root
    num_samples = _int_option("num_samples", num_samples, 1)
    num_test = _int_option("num_test", num_test, 1)
    num_labels = _int_option("num_labels", num_labels, 2)
    num_features = _int_option("num_features", num_features, 1)
    num_topics = _int_option("num_topics", num_topics, 1)
    _generated_size(
        "data synthetic_multilabel",
        (num_samples + num_test) * num_features,
        "data.num_samples, data.num_test or data.num_features",
    )
    max_frequency = _float_option("max_frequency", max_frequency, minimum=0.0, strict=True)
    min_frequency = _float_option("min_frequency", min_frequency, minimum=0.0, strict=True)
    frequency_decay = _float_option("frequency_decay", frequency_decay, minimum=0.0)
    correlation = _float_option("correlation", correlation, minimum=0.0)
    signal = _float_option("signal", signal, minimum=0.0)
    noise = _float_option("noise", noise, minimum=0.0)
    if max_frequency >= 1 or min_frequency > max_frequency:
        raise ConfigError(
            f"'data.min_frequency' <= 'data.max_frequency' < 1 is required, got "
            f"{min_frequency} and {max_frequency}"
        )
    if correlation >= 1:
        raise ConfigError(f"'data.correlation' must be in [0, 1), got {correlation}")
    from scipy.stats import norm

    rng = np.random.default_rng(seed)
    frequency = np.maximum(
        max_frequency * (np.arange(1, num_labels + 1) ** -frequency_decay), min_frequency
    )
    thresholds = norm.ppf(1.0 - frequency)
    topic_of_label = rng.permutation(np.arange(num_labels) % num_topics)
    mixing = rng.standard_normal((num_labels, num_features))
    scale = signal / np.sqrt(max(frequency.sum(), 1.0))

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        topics = rng.standard_normal((count, num_topics))
        z = np.sqrt(correlation) * topics[:, topic_of_label] + np.sqrt(
            1 - correlation
        ) * rng.standard_normal((count, num_labels))
        margin = z - thresholds
        y = margin > 0
        empty = ~y.any(axis=1)
        y[np.flatnonzero(empty), np.argmax(margin[empty], axis=1)] = True
        x = scale * (y @ mixing) + noise * rng.standard_normal((count, num_features))
        return np.ascontiguousarray(x, dtype=np.float32), y.astype(np.uint8)

    train_x, train_y = draw(num_samples)
    test_x, test_y = draw(num_test)
    return Dataset("synthetic_multilabel", train_x, train_y, test_x, test_y, num_labels)


def is_multilabel(dataset: Dataset) -> bool:
    """True for multi-hot targets (n, L); single-label datasets have (n,) class ids."""
    return np.ndim(dataset.train_y) == 2


# --- MULAN ARFF ---------------------------------------------------------------------------------

_NUMERIC_TYPES = {"numeric", "real", "integer"}


def _split_arff_name(text: str, path: str, line_number: int) -> tuple[str, str]:
    """'name type' from an @attribute line's remainder; the name may be quoted."""
    text = text.strip()
    if text[:1] in "'\"":
        quote = text[0]
        end = text.find(quote, 1)
        if end < 0:
            raise DataError(f"{path}:{line_number}: unterminated quoted attribute name")
        return text[1:end], text[end + 1 :].strip()
    parts = text.split(None, 1)
    if len(parts) != 2:
        raise DataError(f"{path}:{line_number}: @attribute needs a name and a type, got {text!r}")
    return parts[0], parts[1].strip()


class _Nominal:
    """A nominal attribute's values, with a dict for the lookup of every value read."""

    def __init__(self, values: list[str]) -> None:
        self.values = values
        # {0,1} label/feature attributes keep their numeric meaning; others become an index
        # (the first, if a value is listed twice).
        binary = values in (["0", "1"], ["1", "0"])
        self.codes: dict[str, float] = {}
        for index, value in enumerate(values):
            self.codes.setdefault(value, float(value) if binary else float(index))

    def __str__(self) -> str:
        shown = ", ".join(self.values[:10]) + (", ..." if len(self.values) > 10 else "")
        return f"{{{shown}}}"


def _nominal_values(kind: str) -> _Nominal | None:
    if not (kind.startswith("{") and kind.endswith("}")):
        return None
    return _Nominal([v.strip().strip("'\"") for v in kind[1:-1].split(",")])


def _parse_value(text: str, nominal: _Nominal | None, path: str, line_number: int, name: str):
    text = text.strip().strip("'\"")
    if nominal is not None:
        code = nominal.codes.get(text)
        if code is None:
            raise DataError(
                f"{path}:{line_number}: value {text[:40]!r} of attribute '{name}' is not one of "
                f"{nominal}"
            )
        return code
    try:
        value = float(text)
    except ValueError:
        raise DataError(
            f"{path}:{line_number}: value {text[:40]!r} of numeric attribute '{name}' is not a "
            f"number" + (" (missing values '?' are not supported)" if text == "?" else "")
        ) from None
    if not np.isfinite(value):
        raise DataError(
            f"{path}:{line_number}: value {text[:40]!r} of attribute '{name}' is not finite"
        )
    return value


# An ARFF file is at most a few hundred MB (MULAN's largest are tens of MB).
ARFF_MAX_BYTES = 2 << 30
# Dense float64 values read_arff may build (2 GiB): sparse rows are densified, so a small file
# can ask for much (50,000 attributes x 6,000 empty rows "{}" is 1.3 MB of file and 2.4 GB of
# rows). The same bound as XC_DENSE_LIMIT below: FLAG's models take dense vectors.
ARFF_DENSE_LIMIT = 1 << 28


def read_arff(path: str) -> tuple[str, list[str], np.ndarray]:
    """(relation, attribute names, float64 data (n, attributes)) of a dense or sparse ARFF.

    The header is read and the rows counted first, so the dense table is checked against
    ARFF_DENSE_LIMIT before it is allocated (once, and filled row by row in place)."""
    content = read_regular_file(path, "ARFF file", ARFF_MAX_BYTES)
    try:
        lines = content.decode("utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DataError(f"cannot read ARFF file {path}: {error}") from None
    del content
    relation, names, kinds = "", [], []
    declared: dict[str, int] = {}
    data_start = None
    for line_number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("%"):
            continue
        lower = line.lower()
        if lower.startswith("@relation"):
            relation = line[len("@relation") :].strip().strip("'\"")
        elif lower.startswith("@attribute"):
            name, kind = _split_arff_name(line[len("@attribute") :], path, line_number)
            nominal = _nominal_values(kind)
            if nominal is None and kind.lower() not in _NUMERIC_TYPES:
                raise DataError(
                    f"{path}:{line_number}: attribute '{name}' has type {kind[:40]!r}; only "
                    f"numeric, real, integer and nominal {{...}} attributes are supported"
                )
            if name in declared:  # which column would a label name mean?
                raise DataError(
                    f"{path}:{line_number}: attribute '{name}' is declared twice (first on "
                    f"line {declared[name]})"
                )
            declared[name] = line_number
            names.append(name)
            kinds.append(nominal)
        elif lower.startswith("@data"):
            if not names:
                raise DataError(f"{path}:{line_number}: @data before any @attribute")
            data_start = line_number  # the rows are the lines after this one
            break
        else:
            raise DataError(
                f"{path}:{line_number}: expected @relation, @attribute or @data, got {line[:40]!r}"
            )
    if data_start is None:
        raise DataError(f"{path}: no @data section (is this an ARFF file?)")
    row_lines = [
        number
        for number in range(data_start + 1, len(lines) + 1)
        if (text := lines[number - 1].strip()) and not text.startswith("%")
    ]
    if not row_lines:
        raise DataError(f"{path}: the @data section holds no rows")
    if len(row_lines) * len(names) > ARFF_DENSE_LIMIT:
        raise DataError(
            f"{path}: {len(row_lines)} rows x {len(names)} attributes is too large to densify "
            f"for FLAG (limit {ARFF_DENSE_LIMIT} values); use a smaller dataset"
        )
    table = np.zeros((len(row_lines), len(names)))
    for row_index, line_number in enumerate(row_lines):
        line = lines[line_number - 1].strip()
        row = table[row_index]
        if line.startswith("{"):
            if not line.endswith("}"):
                raise DataError(f"{path}:{line_number}: sparse row must end with '}}'")
            seen: set[int] = set()
            for item in filter(None, (s.strip() for s in line[1:-1].split(","))):
                parts = item.split(None, 1)
                index = ascii_uint(parts[0]) if len(parts) == 2 else None
                if index is None:
                    raise DataError(
                        f"{path}:{line_number}: sparse entry {item[:40]!r} is not 'index value'"
                    )
                if index >= len(names):
                    raise DataError(
                        f"{path}:{line_number}: sparse index {parts[0][:20]} >= {len(names)} "
                        f"attributes"
                    )
                if index in seen:  # which of the two values would be meant?
                    raise DataError(f"{path}:{line_number}: sparse index {index} is given twice")
                seen.add(index)
                row[index] = _parse_value(parts[1], kinds[index], path, line_number, names[index])
        else:
            values = line.split(",")
            if len(values) != len(names):
                raise DataError(
                    f"{path}:{line_number}: {len(values)} values but {len(names)} attributes"
                )
            for index, text in enumerate(values):
                row[index] = _parse_value(text, kinds[index], path, line_number, names[index])
    return relation, names, table


MULAN_XML_MAX_BYTES = 64 << 20  # a labels file names a few thousand labels at most


def read_mulan_labels(path: str) -> list[str]:
    """Label names from a MULAN labels XML file (<label name="..."/>, nested or flat)."""
    content = read_regular_file(path, "MULAN labels XML", MULAN_XML_MAX_BYTES)
    try:
        # expat refuses entity expansion bombs itself ("billion laughs"), and ElementTree
        # never fetches external entities.
        tree = ElementTree.fromstring(content)
    except ElementTree.ParseError as error:
        raise DataError(f"cannot read MULAN labels XML {path}: {error}") from None
    names = [
        element.get("name") for element in tree.iter() if element.tag.rsplit("}", 1)[-1] == "label"
    ]
    if not names or any(name is None for name in names):
        raise DataError(f'{path}: expected <label name="..."> elements')
    return names  # type: ignore[return-value]


def _resolve(root: str | None, name: str) -> str:
    return name if os.path.isabs(name) or root is None else os.path.join(root, name)


def load_arff(
    root: str | None,
    seed: int,
    *,
    train_file: str = "",
    test_file: str | None = None,
    xml_file: str | None = None,
    labels: Sequence[str] | None = None,
    test_fraction: float = 0.25,
) -> Dataset:
    """A MULAN multi-label dataset from ARFF files (paths relative to `data.root`).

    The label attributes are named by `labels`, or read from MULAN's companion `xml_file`;
    every other attribute is a feature (standardised with the training mean and std). Without a
    `test_file` the training file is split (`test_fraction`, seeded by `seed`).
    """
    if not train_file:
        raise ConfigError("dataset 'arff' needs 'data.train_file' (an ARFF file in data.root)")
    train_path = _resolve(root, train_file)
    if not os.path.lexists(train_path):  # a FIFO or folder there is refused by the reader
        raise DataError(f"dataset 'arff': file not found: {train_path}")
    if labels is None and xml_file is None:
        raise ConfigError(
            "dataset 'arff' needs the label attributes: 'data.labels' (a list of names) or "
            "'data.xml_file' (MULAN's labels XML)"
        )
    label_names = (
        list(labels) if labels is not None else read_mulan_labels(_resolve(root, xml_file))
    )
    _, names, train = read_arff(train_path)
    column = {name: index for index, name in enumerate(names)}  # names are unique (read_arff)
    missing = [name for name in label_names if name not in column]
    if missing:
        raise DataError(
            f"{train_path}: label attribute(s) {', '.join(map(repr, missing[:5]))} not found "
            f"among its {len(names)} attributes"
        )
    label_index = [column[name] for name in label_names]
    label_columns = set(label_index)
    feature_index = [i for i in range(len(names)) if i not in label_columns]
    if test_file is not None:
        test_path = _resolve(root, test_file)
        if not os.path.lexists(test_path):
            raise DataError(f"dataset 'arff': file not found: {test_path}")
        _, test_names, test = read_arff(test_path)
        if test_names != names:
            raise DataError(f"{test_path}: its attributes differ from those of {train_path}")
    else:
        fraction = _float_option("test_fraction", test_fraction, minimum=0.0, strict=True)
        if fraction >= 1:
            raise ConfigError(f"'data.test_fraction' must be in (0, 1), got {test_fraction}")
        order = np.random.default_rng(seed).permutation(len(train))
        cut = max(1, int(round(len(train) * fraction)))
        train, test = train[order[cut:]], train[order[:cut]]
    for name, table, path in (
        ("train", train, train_path),
        ("test", test, test_file or train_path),
    ):
        values = table[:, label_index]
        bad = (values != 0) & (values != 1)
        if bad.any():
            row, column = np.argwhere(bad)[0]
            raise DataError(
                f"{path}: {name} row {row}: label '{label_names[column]}' = {values[row, column]}"
                f" is not 0 or 1"
            )
    mean = train[:, feature_index].mean(axis=0)
    std = train[:, feature_index].std(axis=0)
    std[std == 0] = 1.0

    def features(table: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((table[:, feature_index] - mean) / std, dtype=np.float32)

    return Dataset(
        name="arff",
        train_x=features(train),
        train_y=train[:, label_index].astype(np.uint8),
        test_x=features(test),
        test_y=test[:, label_index].astype(np.uint8),
        num_classes=len(label_names),
    )


# --- MS-COCO 2014 ---------------------------------------------------------------------------------

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _coco_field(record: Any, key: str, where: str, path: str, kind: type | tuple) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{path}: field '{where}.{key}' is missing")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise DataError(f"{path}: field '{where}.{key}' has the wrong type ({value!r})")
    return value


# The image x category label matrix (uint8) read_coco_annotations may build: COCO 2014 needs
# 82,783 x 80 = 6.6 M cells; the counts come from the file, so a small file listing many images
# and many categories would otherwise ask for tens of GiB (13 MB of JSON -> 37 GiB).
COCO_LABEL_LIMIT = 1 << 28
# Pixels of one image decoded before it is resized (COCO's are at most 640 x 640): a few KB of
# PNG can declare 20,000 x 20,000 pixels of zeros (a decompression bomb).
COCO_MAX_IMAGE_PIXELS = 1 << 26
COCO_IMAGE_MAX_BYTES = 256 << 20
# The formats PIL may decode here (COCO is JPEG): not every plug-in PIL has (EPS runs
# Ghostscript, for one) should be reachable from a file a dataset folder holds.
COCO_IMAGE_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WEBP", "PPM")


def _unique_ids(records: list[tuple[int, str]], field: str, path: str) -> None:
    """Refuse an id listed twice (records sorted by id): which of the two would it mean?"""
    for (first, _), (second, _) in zip(records, records[1:], strict=False):
        if first == second:
            raise DataError(f"{path}: field '{field}' = {first} is listed twice (ids are unique)")


def read_coco_annotations(path: str) -> tuple[list[tuple[int, str]], np.ndarray, list[str]]:
    """(images (id, file_name) sorted by id, multi-hot (n, C) uint8, category names) of an
    `instances_*.json`; categories are ordered by id (COCO 2014: 80 of ids 1..90)."""
    content = read_json_file(path, "COCO annotations")
    for key in ("images", "annotations", "categories"):
        if not isinstance(content, dict) or not isinstance(content.get(key), list):
            raise DataError(f"{path}: field '{key}' is missing or not a list")
    categories = sorted(
        (
            _coco_field(c, "id", f"categories[{i}]", path, int),
            _coco_field(c, "name", f"categories[{i}]", path, str),
        )
        for i, c in enumerate(content["categories"])
    )
    _unique_ids(categories, "categories[].id", path)
    column = {category_id: index for index, (category_id, _) in enumerate(categories)}
    images = sorted(
        (
            _coco_field(image, "id", f"images[{i}]", path, int),
            _coco_field(image, "file_name", f"images[{i}]", path, str),
        )
        for i, image in enumerate(content["images"])
    )
    _unique_ids(images, "images[].id", path)
    if len(images) * len(categories) > COCO_LABEL_LIMIT:
        raise DataError(
            f"{path}: {len(images)} images x {len(categories)} categories is too large a label "
            f"matrix (limit {COCO_LABEL_LIMIT} cells; COCO 2014 has 82,783 x 80)"
        )
    row = {image_id: index for index, (image_id, _) in enumerate(images)}
    labels = np.zeros((len(images), len(categories)), dtype=np.uint8)
    for i, annotation in enumerate(content["annotations"]):
        where = f"annotations[{i}]"
        image_id = _coco_field(annotation, "image_id", where, path, int)
        category_id = _coco_field(annotation, "category_id", where, path, int)
        if image_id not in row:
            raise DataError(
                f"{path}: field '{where}.image_id' = {str(image_id)[:30]} is not in 'images'"
            )
        if category_id not in column:
            raise DataError(
                f"{path}: field '{where}.category_id' = {str(category_id)[:30]} is not in "
                f"'categories'"
            )
        labels[row[image_id], column[category_id]] = 1
    return images, labels, [name for _, name in categories]


def _read_image(path: str, size: int) -> Any:
    """One image as RGB resized to (size, size); every failure one DataError naming the file."""
    import warnings

    from PIL import Image

    handle, _ = open_regular_file(
        path, "COCO image", COCO_IMAGE_MAX_BYTES, missing=f"COCO image not found: {path}"
    )
    try:
        with handle, warnings.catch_warnings():
            # PIL only warns below twice its own pixel limit; refuse, never decode a bomb.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(handle, formats=COCO_IMAGE_FORMATS) as image:
                width, height = image.size  # from the header: nothing is decoded yet
                if width * height > COCO_MAX_IMAGE_PIXELS:
                    raise DataError(
                        f"COCO image {path} is {width} x {height} pixels, more than "
                        f"{COCO_MAX_IMAGE_PIXELS:,} (a decompression bomb?)"
                    )
                return image.convert("RGB").resize((size, size), Image.BILINEAR)
    except DataError:
        raise
    except Exception as error:  # PIL's plug-ins raise many types on a broken file
        if isinstance(error, Image.UnidentifiedImageError):
            reason = f"not a {', '.join(COCO_IMAGE_FORMATS)} image"
        else:
            reason = f"{type(error).__name__}: {str(error)[:200]}"
        raise DataError(f"cannot read COCO image {path}: {reason}") from None


def _load_images(folder: str, files: list[str], size: int, source: str = "") -> np.ndarray:
    """torchvision-style Resize((size, size)) + ToTensor + Normalize(ImageNet) -> NCHW.

    `files` come from the annotations file `source`: each must name a file inside `folder`."""
    paths = [path_under(folder, name, "file_name", source or folder) for name in files]
    try:
        out = np.empty((len(files), 3, size, size), dtype=np.float32)
    except MemoryError:
        raise DataError(
            f"{len(files)} COCO images of {size} x {size} need {len(files) * 12 * size * size:,}"
            f" bytes, more than this machine has; set data.max_train / data.max_test or a "
            f"smaller data.image_size"
        ) from None
    mean = np.asarray(IMAGENET_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(IMAGENET_STD, dtype=np.float32)[:, None, None]
    for index, path in enumerate(paths):
        resized = _read_image(path, size)
        pixels = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        out[index] = (pixels - mean) / std
    return out


def load_coco(
    root: str | None,
    seed: int,
    *,
    image_size: int = 64,
    max_train: int | None = None,
    max_test: int | None = None,
    keep_unlabelled: bool = False,
) -> Dataset:
    """MS-COCO 2014 as 80-label multi-hot vectors (FLAG's main dataset).

    Reads `annotations/instances_train2014.json` and `instances_val2014.json` in `data.root`
    and the images from `train2014/` and `val2014/` (the layout of the official zips), resized
    to image_size x image_size. val2014 is the validation set that CMDA splits over clients.
    Images without any annotation are dropped (unless keep_unlabelled). `max_train` /
    `max_test` keep the first images by id, for quick runs.
    """
    del seed
    if root is None or not os.path.isdir(root):
        raise DataError(
            f"dataset 'coco': data.root {root!r} is not a directory (expected annotations/, "
            f"train2014/ and val2014/ from cocodataset.org's 2014 zips)"
        )
    image_size = _int_option("image_size", image_size, 8)
    arrays = []
    names: list[str] = []
    for split, limit in (("train2014", max_train), ("val2014", max_test)):
        annotations = os.path.join(root, "annotations", f"instances_{split}.json")
        if not os.path.lexists(annotations):  # a FIFO or folder there is refused by the reader
            raise DataError(f"dataset 'coco': file not found: {annotations}")
        images, labels, split_names = read_coco_annotations(annotations)
        if names and split_names != names:
            raise DataError(f"{annotations}: its categories differ from instances_train2014.json")
        names = split_names
        keep = np.arange(len(images)) if keep_unlabelled else np.flatnonzero(labels.any(axis=1))
        if limit is not None:
            keep = keep[
                : _int_option("max_train" if split == "train2014" else "max_test", limit, 1)
            ]
        if not len(keep):
            raise DataError(f"{annotations}: no (labelled) images")
        files = [images[i][1] for i in keep]
        images_x = _load_images(os.path.join(root, split), files, image_size, annotations)
        arrays.append((images_x, labels[keep]))
    (train_x, train_y), (test_x, test_y) = arrays
    return Dataset("coco", train_x, train_y, test_x, test_y, num_classes=len(names))


# --- Extreme Classification Repository text files (shared reader: raysim.data.xml) -------------

XC_DENSE_LIMIT = 1 << 28  # dense feature values (1 GiB of float32) a FLAG-sized XC set may use


def load_xc_multilabel(
    root: str | None,
    seed: int,
    *,
    train_file: str = "train.txt",
    test_file: str = "test.txt",
) -> Dataset:
    """Small XC datasets (Mediamill, Bibtex, Delicious, ...) as FLAG data: dense features and
    multi-hot labels, read with raysim.data.xml's parser (which names file and line on error).

    FLAG's models take dense vectors, so features are densified; sets whose points x features
    exceed XC_DENSE_LIMIT are refused (FedAwS's sparse path is the one for extreme sizes).
    """
    from raysim.data.xml import label_sets_to_multi_hot, parse_xc_file

    del seed
    train_path, test_path = _resolve(root, train_file), _resolve(root, test_file)
    for path in (train_path, test_path):
        if not os.path.lexists(path):  # a FIFO or folder there is refused by the reader
            raise DataError(f"dataset 'xc_multilabel': file not found: {path}")
    train = parse_xc_file(train_path)
    test = parse_xc_file(test_path, num_features=train.num_features, num_labels=train.num_labels)
    points = train.num_points + test.num_points
    # Both dense tables are sized by the header's counts: check them before allocating.
    for count, name in ((train.num_features, "features"), (train.num_labels, "labels")):
        if points * count > XC_DENSE_LIMIT:
            raise DataError(
                f"{train_path}: {points} points x {count} {name} is too large to densify for "
                f"FLAG (limit {XC_DENSE_LIMIT} values); use a smaller XC dataset"
            )

    def dense(data) -> np.ndarray:
        x = np.zeros((data.num_points, data.num_features), dtype=np.float32)
        rows = np.repeat(np.arange(data.num_points), np.diff(data.feature_indptr))
        x[rows, data.feature_ids] = data.feature_values
        return x

    def labels(data) -> np.ndarray:
        return label_sets_to_multi_hot(data.label_indptr, data.label_ids, data.num_labels)

    return Dataset(
        "xc_multilabel", dense(train), labels(train), dense(test), labels(test), train.num_labels
    )
