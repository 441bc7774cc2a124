"""MULAN multi-label datasets from ARFF files: the ARFF reader, MULAN's labels XML, `load_arff`.

An ARFF file declares its attributes (numeric or nominal) and then holds dense or sparse rows;
MULAN marks which attributes are labels in a companion XML file, or the user names them. A
malformed file is one `DataError` naming the file and the line.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence

import numpy as np

from raysim.data.datasets import Dataset
from raysim.data.files import ascii_uint, read_regular_file, resolve_data_path
from raysim.data.options import _float_option
from raysim.errors import ConfigError, DataError

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
# rows). The same bound as XC_DENSE_LIMIT (raysim.data.xc_datasets): FLAG's models take dense
# vectors.
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
    train_path = resolve_data_path(root, train_file)
    if not os.path.lexists(train_path):  # a FIFO or folder there is refused by the reader
        raise DataError(f"dataset 'arff': file not found: {train_path}")
    if labels is None and xml_file is None:
        raise ConfigError(
            "dataset 'arff' needs the label attributes: 'data.labels' (a list of names) or "
            "'data.xml_file' (MULAN's labels XML)"
        )
    label_names = (
        list(labels) if labels is not None else read_mulan_labels(resolve_data_path(root, xml_file))
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
        test_path = resolve_data_path(root, test_file)
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
