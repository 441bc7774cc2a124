"""MS-COCO 2014 as multi-label data: `instances_{train,val}2014.json` -> 80-label multi-hot vectors.

Images are read from `{train,val}2014/` and resized like torchvision's Resize + ToTensor +
Normalize (ImageNet statistics). Every size is checked before it is allocated (the label matrix,
each image's pixel count), file names must stay inside their image folder, and a malformed
annotations file is one `DataError` naming the JSON field.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from raysim.data.datasets import Dataset
from raysim.data.files import open_regular_file, path_under, read_json_file
from raysim.data.options import _int_option
from raysim.errors import DataError

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
