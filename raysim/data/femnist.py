"""FEMNIST from LEAF's json files: 62 classes, each train sample tagged with its writer.

LEAF (github.com/TalwalkarLab/leaf) writes `train/*.json` and `test/*.json`; each file lists its
users and, per user, flattened 28x28 images and labels. The writers become `train_groups`, so the
'natural' partition gives every writer its own client.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from raysim.data.datasets import Dataset
from raysim.data.files import _require_root, read_json_file
from raysim.data.options import _int_option
from raysim.errors import DataError

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
    root = _require_root(root, "femnist", "LEAF's train/ and test/ json folders", how=_FEMNIST_HOW)
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
