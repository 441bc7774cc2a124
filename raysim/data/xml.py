"""The reader of the Extreme Classification Repository text format (extreme multi-label data).

The repository (http://manikvarma.org/downloads/XC/XMLRepository.html) ships each dataset as
`train.txt` / `test.txt`, or, for the small datasets, one data file plus `trSplit.txt` /
`tstSplit.txt` holding the rows of each train/test split. A data file is

    points features labels          <- header: three non-negative integers
    l1,l2,... f:v f:v ...           <- one line per point; 0-based label and feature ids

where the label list may be empty (the line then starts with a space, or with a feature).

The reader is vectorised: it reads the file once and parses ~16 MB blocks of lines with numpy
(token structure from byte classes) and every number of a block through one call of Arrow's
CSV parser, so a 490,000-line file takes seconds, not minutes (~0.2-0.6 us per token, against
~3 us line by line). Any block the fast path does not accept is re-parsed line by line in plain
Python, which names the file, the 1-based line and what was expected; only a block with an
error (or an unusual byte such as a non-ASCII character) pays that price. Both paths accept
exactly the same inputs and give identical arrays (tested).

The parser returns `raysim.data.xc_data.XCData`; raysim.data.xc_datasets turns that into
datasets.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from raysim.data.files import ascii_uint, read_regular_file
from raysim.data.xc_data import XCData
from raysim.errors import DataError

XC_REPOSITORY = "http://manikvarma.org/downloads/XC/XMLRepository.html"
XC_HOW_TO_OBTAIN = (
    f"download the dataset from the Extreme Classification Repository ({XC_REPOSITORY}) on a "
    f"machine with internet access and copy its train.txt/test.txt (or, for the small datasets, "
    f"the data file with trSplit.txt/tstSplit.txt) into data.root"
)
_BLOCK_BYTES = 16 << 20  # lines are parsed in blocks of about this size (bounds memory)


# Bytes the fast path accepts; anything else (tabs aside, which become spaces) goes line by line.
_ALLOWED_BYTES = b"0123456789.eE+-:, \n"
_DIGIT = np.zeros(256, dtype=bool)
_DIGIT[list(b"0123456789")] = True
_TO_SPACE = bytes.maketrans(b"\t\r\x0b\x0c", b"    ")
_ONE_NUMBER_PER_LINE = bytes.maketrans(b":, ", b"\n\n\n")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_VALUE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _missing(path: str) -> DataError:
    return DataError(f"extreme classification file not found: {path}; {XC_HOW_TO_OBTAIN}")


# The largest files of the repository are a few GB (Amazon-3M's train.txt); the reader holds a
# file in memory, so one larger than this is refused before it is read.
XC_MAX_BYTES = 16 << 30
# Feature ids are int32 (and `num_features` pads them), so counts must fit: a larger header
# would let ids of 2^31 and more wrap around silently.
XC_MAX_COUNT = (1 << 31) - 1


def _read_bytes(path: str, what: str = "extreme classification file") -> bytes:
    return read_regular_file(path, what, XC_MAX_BYTES, missing=str(_missing(path)))


def _parse_header(path: str, line: bytes, body_bytes: int) -> tuple[int, int, int]:
    """(points, features, labels) of line 1, checked against what the file can hold: each
    point is a line (at least its newline) of the `body_bytes` after the header, and ids fit
    int32. Nothing is allocated from the counts before this check."""
    text = line.decode("utf-8", errors="replace").strip()
    parts = text.split()
    counts = [ascii_uint(part) for part in parts]  # ASCII only: int() refuses '²'
    if len(parts) != 3 or None in counts:
        raise DataError(
            f"{path}, line 1: bad header {text[:80]!r}: expected 'points features labels' "
            f"(three non-negative integers, e.g. '490449 135909 670091')"
        )
    points, features, labels = counts
    for name, count, text_count in zip(("features", "labels"), counts[1:], parts[1:], strict=True):
        if count > XC_MAX_COUNT:
            raise DataError(
                f"{path}, line 1: header says {text_count[:30]} {name}; at most {XC_MAX_COUNT} "
                f"are supported (ids are 32-bit)"
            )
    if points > body_bytes:
        raise DataError(
            f"{path}, line 1: header says {parts[0][:30]} points but the file has only "
            f"{body_bytes} bytes after line 1, at most {body_bytes} lines (truncated file?)"
        )
    return points, features, labels


class _Block:
    """Parsed lines: per-line label and feature counts, then the flat ids and values."""

    def __init__(self, label_counts, labels, feature_counts, feature_ids, feature_values):
        self.label_counts = label_counts
        self.labels = labels
        self.feature_counts = feature_counts
        self.feature_ids = feature_ids
        self.feature_values = feature_values


def _parse_line(
    text: str, where: str, num_features: int, num_labels: int
) -> tuple[list[int], list[int], list[float]]:
    """One point's line, strictly; the reference the fast path must agree with."""
    tokens = text.split()
    labels: list[int] = []
    if tokens and ":" not in tokens[0]:
        label_text = tokens.pop(0)
        for part in label_text.split(","):
            label = ascii_uint(part)
            if label is None:
                raise DataError(
                    f"{where}: label list {label_text[:80]!r} is not comma-separated "
                    f"non-negative integers (expected e.g. '3,17,42', or nothing before the "
                    f"features)"
                )
            if label >= num_labels:
                shown = label if label < 10**18 else part[:30] + "..."
                raise DataError(f"{where}: label id {shown} is out of range [0, {num_labels})")
            labels.append(label)
    ids: list[int] = []
    values: list[float] = []
    for token in tokens:
        id_text, colon, value_text = token.partition(":")
        feature = ascii_uint(id_text)
        if not colon or feature is None or not _VALUE.fullmatch(value_text):
            if colon and feature is not None and _non_finite(value_text):
                raise DataError(
                    f"{where}: feature {id_text[:30]} has a non-finite value {value_text[:40]!r}"
                )
            raise DataError(
                f"{where}: {token[:80]!r} is not a feature:value pair (expected "
                f"<feature id>:<number>, e.g. '12:0.5')"
            )
        if feature >= num_features:
            shown = feature if feature < 10**18 else id_text[:30] + "..."
            raise DataError(f"{where}: feature id {shown} is out of range [0, {num_features})")
        value = float(value_text)
        if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
            raise DataError(
                f"{where}: feature {feature} has a non-finite value {value_text!r} "
                f"(float32 overflow or inf/nan)"
            )
        ids.append(feature)
        values.append(value)
    return labels, ids, values


def _non_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _parse_block_slowly(
    block: bytes, path: str, first_line: int, num_features: int, num_labels: int
) -> _Block:
    label_counts, feature_counts = [], []
    labels: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for offset, raw in enumerate(block.split(b"\n")[:-1]):  # the block ends with a newline
        where = f"{path}, line {first_line + offset}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{where}: not UTF-8 text (is this an XC data file?)") from None
        line_labels, line_ids, line_values = _parse_line(text, where, num_features, num_labels)
        label_counts.append(len(line_labels))
        feature_counts.append(len(line_ids))
        labels += line_labels
        ids += line_ids
        values += line_values
    return _Block(
        np.asarray(label_counts, dtype=np.int64),
        np.asarray(labels, dtype=np.int64),
        np.asarray(feature_counts, dtype=np.int64),
        np.asarray(ids, dtype=np.int32),
        np.asarray(values, dtype=np.float32),
    )


def _parse_numbers(text: bytes) -> np.ndarray | None:
    """float64 of every number in `text` (one per line), via Arrow's multi-threaded CSV parser
    (correctly rounded, ~5x faster than np.fromstring); None if any line is not a number."""
    import pyarrow
    import pyarrow.csv

    try:
        table = pyarrow.csv.read_csv(
            pyarrow.BufferReader(text),
            read_options=pyarrow.csv.ReadOptions(column_names=["v"], block_size=8 << 20),
            parse_options=pyarrow.csv.ParseOptions(
                delimiter="\x01", quote_char=False, escape_char=False, ignore_empty_lines=True
            ),
            convert_options=pyarrow.csv.ConvertOptions(
                column_types={"v": pyarrow.float64()},
                null_values=[],
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except pyarrow.ArrowInvalid:
        return None
    column = table.column("v")
    if column.null_count:
        return None
    return column.to_numpy()


def _parse_block_fast(block: bytes, num_features: int, num_labels: int) -> _Block | None:
    """Vectorised parse of whole lines; None if anything is off (the slow path then explains)."""
    if block.translate(None, _ALLOWED_BYTES):  # a byte the fast path does not handle
        return None
    raw = np.frombuffer(block, dtype=np.uint8)
    newline = raw == 10
    separator = newline | (raw == 32)
    is_start = ~separator
    is_start[1:] &= separator[:-1]
    token_of_byte = np.cumsum(is_start, dtype=np.int32)
    token_of_byte -= 1  # the token each byte belongs to (a separator: the one before it)
    del is_start
    tokens = int(token_of_byte[-1]) + 1
    newlines = np.flatnonzero(newline)
    del newline
    lines = len(newlines)
    tokens_per_line = np.diff(token_of_byte[newlines], prepend=-1)
    token_line = np.repeat(np.arange(lines), tokens_per_line)

    colons = np.flatnonzero(raw == 58)
    commas = np.flatnonzero(raw == 44)
    colon_count = np.bincount(token_of_byte[colons], minlength=tokens)
    comma_count = np.bincount(token_of_byte[commas], minlength=tokens)
    first = np.ones(tokens, dtype=bool)
    first[1:] = token_line[1:] != token_line[:-1]
    is_label = first & (colon_count == 0)
    is_feature = ~is_label
    if np.any(is_feature & ((colon_count != 1) | (comma_count != 0))):
        return None
    # A colon sits between an id and a value; a comma between two label digits.
    if np.any(separator[colons - 1] | separator[colons + 1] | (raw[colons + 1] == 58)):
        return None
    if np.any(~_DIGIT[raw[commas - 1]] | ~_DIGIT[raw[commas + 1]]):
        return None
    # '.', 'e', '+', '-' may only appear in a value (after its token's colon).
    digit = (raw - np.uint8(48)) < 10
    others = np.flatnonzero(~(separator | digit | (raw == 58) | (raw == 44)))
    del digit
    del separator
    if len(others):
        other_token = token_of_byte[others]
        colon_of_token = np.full(tokens, np.iinfo(np.int64).max, dtype=np.int64)
        colon_of_token[token_of_byte[colons]] = colons
        if np.any(is_label[other_token] | (others < colon_of_token[other_token])):
            return None
    del token_of_byte

    numbers_per_token = np.where(is_label, comma_count + 1, 2)
    if tokens == 0:  # blank lines only
        zeros = np.zeros(lines, dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        return _Block(zeros, empty, zeros, empty.astype(np.int32), empty.astype(np.float32))
    numbers = _parse_numbers(block.translate(_ONE_NUMBER_PER_LINE))
    if numbers is None or len(numbers) != int(numbers_per_token.sum()):
        return None
    token_offset = np.cumsum(numbers_per_token) - numbers_per_token

    feature_offset = token_offset[is_feature]
    ids = numbers[feature_offset]
    values = numbers[feature_offset + 1]
    label_token_count = numbers_per_token[is_label]
    label_positions = np.repeat(token_offset[is_label], label_token_count) + (
        np.arange(int(label_token_count.sum()))
        - np.repeat(np.cumsum(label_token_count) - label_token_count, label_token_count)
    )
    labels = numbers[label_positions]
    if (
        np.any(ids >= num_features)
        or np.any(labels >= num_labels)
        or not (np.abs(values) <= _FLOAT32_MAX).all()  # also False for nan
    ):
        return None
    return _Block(
        np.bincount(np.repeat(token_line[is_label], label_token_count), minlength=lines).astype(
            np.int64
        ),
        labels.astype(np.int64),
        np.bincount(token_line[is_feature], minlength=lines).astype(np.int64),
        ids.astype(np.int32),
        values.astype(np.float32),
    )


def _indptr(counts: list[np.ndarray]) -> np.ndarray:
    joined = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    indptr = np.zeros(len(joined) + 1, dtype=np.int64)
    np.cumsum(joined, out=indptr[1:])
    return indptr


def parse_xc_file(
    path: str | os.PathLike, *, num_features: int | None = None, num_labels: int | None = None
) -> XCData:
    """Read one Extreme Classification Repository data file (header + one line per point).

    `num_features` / `num_labels`, when given, must equal the header's (e.g. a test file must
    match its train file). Any malformed input is a `DataError` naming the file and line.
    """
    path = os.fspath(path)
    content = _read_bytes(path)
    header_end = content.find(b"\n")
    if header_end < 0:
        header_end = len(content)
    points, header_features, header_labels = _parse_header(
        path, content[:header_end], len(content) - header_end
    )
    for name, given, found in (
        ("features", num_features, header_features),
        ("labels", num_labels, header_labels),
    ):
        if given is not None and given != found:
            raise DataError(
                f"{path}, line 1: header says {found} {name} but {given} were expected "
                f"(the train and test files of one dataset share their feature and label counts)"
            )
    if not content.endswith(b"\n"):
        content += b"\n"
    body = content  # the points start at header_end + 1 (no copy of a file of ~0.5 GB)

    blocks: list[_Block] = []
    position, lines_done = header_end + 1, 0
    while lines_done < points and position < len(body):
        end = body.find(b"\n", min(position + _BLOCK_BYTES, len(body) - 1))
        block = body[position : end + 1]
        count = block.count(b"\n")
        if lines_done + count > points:  # the file has more lines than points: stop at the last
            cut = -1
            for _ in range(points - lines_done):
                cut = block.find(b"\n", cut + 1)
            block, count = block[: cut + 1], points - lines_done
        block = block.translate(_TO_SPACE)
        parsed = _parse_block_fast(block, header_features, header_labels)
        if parsed is None:
            parsed = _parse_block_slowly(
                block, path, lines_done + 2, header_features, header_labels
            )
        blocks.append(parsed)
        position += len(block)
        lines_done += count
    if lines_done < points:
        raise DataError(
            f"{path}, line {lines_done + 2}: the file ends after {lines_done} points but its "
            f"header (line 1) says {points} points (truncated file?)"
        )
    rest = body[position:]
    if rest.strip():
        extra_line = lines_done + 2 + rest[: len(rest) - len(rest.lstrip())].count(b"\n")
        raise DataError(
            f"{path}, line {extra_line}: more points than the {points} the header (line 1) "
            f"says (expected only blank lines after line {points + 1})"
        )
    return XCData(
        num_features=header_features,
        num_labels=header_labels,
        label_indptr=_indptr([b.label_counts for b in blocks]),
        label_ids=np.concatenate([b.labels for b in blocks] or [np.zeros(0, np.int64)]),
        feature_indptr=_indptr([b.feature_counts for b in blocks]),
        feature_ids=np.concatenate([b.feature_ids for b in blocks] or [np.zeros(0, np.int32)]),
        feature_values=np.concatenate(
            [b.feature_values for b in blocks] or [np.zeros(0, np.float32)]
        ),
    )


def read_split_file(path: str | os.PathLike, column: int, num_points: int) -> np.ndarray:
    """0-based rows of split `column` from a small-dataset split file (1-based row indices)."""
    path = os.fspath(path)
    content = _read_bytes(path, "extreme classification split file")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text (is this an XC split file?)") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) <= column:
            raise DataError(
                f"{path}, line {number}: has {len(parts)} split column(s) but split {column} "
                f"was asked for (data.split must be < the number of columns)"
            )
        part = parts[column]
        row = ascii_uint(part)
        if row is None or not 1 <= row <= num_points:
            raise DataError(
                f"{path}, line {number}: {part[:30]!r} is not a row index in [1, {num_points}] "
                f"(split files hold 1-based rows of the data file)"
            )
        rows.append(row - 1)
    if not rows:
        raise DataError(f"{path}: no rows (expected one line of 1-based row indices per point)")
    return np.asarray(rows, dtype=np.int64)
