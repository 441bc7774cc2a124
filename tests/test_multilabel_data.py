"""Multi-label loaders on tiny files written here: MULAN ARFF (dense, sparse, XML labels),
MS-COCO 2014 annotations + images, the synthetic default; one clear error per malformed file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raysim.data.arff import load_arff
from raysim.data.coco import load_coco
from raysim.data.multilabel import load_synthetic_multilabel
from raysim.errors import DataError

DENSE = """% a MULAN-style file
@relation 'tiny: -C 2'
@attribute f1 numeric
@attribute 'f two' real
@attribute sunny {0,1}
@attribute rainy {0,1}
@data
1.0,2.0,1,0
3.0,-1.0,0,1
5.0,0.5,1,1
7.0,2.5,0,0
"""

SPARSE = """@relation tiny
@attribute f1 numeric
@attribute 'f two' real
@attribute sunny {0,1}
@attribute rainy {0,1}
@data
{0 1.0,1 2.0,2 1}
{0 3.0,1 -1.0,3 1}
{}
"""

XML = """<?xml version="1.0" encoding="utf-8"?>
<labels xmlns="http://mulan.sourceforge.net/labels">
<label name="sunny"></label>
<label name="rainy"></label>
</labels>
"""


def test_arff_dense_with_labels_from_xml(tmp_path):
    (tmp_path / "train.arff").write_text(DENSE)
    (tmp_path / "test.arff").write_text(SPARSE)
    (tmp_path / "tiny.xml").write_text(XML)
    data = load_arff(
        str(tmp_path), 0, train_file="train.arff", test_file="test.arff", xml_file="tiny.xml"
    )
    assert data.num_classes == 2
    np.testing.assert_array_equal(data.train_y, [[1, 0], [0, 1], [1, 1], [0, 0]])
    np.testing.assert_array_equal(data.test_y, [[1, 0], [0, 1], [0, 0]])
    assert data.train_x.shape == (4, 2) and data.train_x.dtype == np.float32
    np.testing.assert_allclose(data.train_x.mean(axis=0), 0, atol=1e-6)  # standardised
    # sparse rows: unlisted attributes are 0, standardised with the training statistics
    mean, std = np.array([4.0, 1.0]), np.array([np.sqrt(5.0), np.sqrt(1.875)])
    np.testing.assert_allclose(data.test_x[2], (0 - mean) / std, rtol=1e-6)


def test_arff_labels_named_by_the_user_and_a_seeded_test_split(tmp_path):
    (tmp_path / "all.arff").write_text(DENSE)
    data = load_arff(str(tmp_path), 1, train_file="all.arff", labels=["rainy"], test_fraction=0.25)
    assert data.num_classes == 1 and len(data.train_y) == 3 and len(data.test_y) == 1
    assert data.train_x.shape[1] == 3  # f1, f two and the non-label 'sunny'


@pytest.mark.parametrize(
    "text, message",
    [
        (DENSE.replace("3.0,-1.0,0,1", "3.0,-1.0,0"), "train.arff:9: 3 values but 4 attributes"),
        (DENSE.replace("5.0,0.5,1,1", "5.0,abc,1,1"), "train.arff:10: value 'abc'"),
        (DENSE.replace("5.0,0.5,1,1", "5.0,0.5,2,1"), "train.arff:10: value '2' of attribute"),
        (DENSE.replace("@attribute f1 numeric", "@attribute f1 string"), "train.arff:3:"),
        (DENSE.replace("@data", ""), "train.arff:8: expected @relation, @attribute or @data"),
        (SPARSE.replace("{0 3.0,1 -1.0,3 1}", "{0 3.0,9 1}"), "train.arff:8: sparse index 9"),
    ],
)
def test_malformed_arff_names_file_and_line(tmp_path, text, message):
    (tmp_path / "train.arff").write_text(text)
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        load_arff(str(tmp_path), 0, train_file="train.arff", labels=["sunny", "rainy"])


def test_arff_unknown_label_attribute(tmp_path):
    (tmp_path / "train.arff").write_text(DENSE)
    with pytest.raises(DataError, match="'cloudy' not found"):
        load_arff(str(tmp_path), 0, train_file="train.arff", labels=["cloudy"])


def _write_coco(root, annotations_by_split):
    from PIL import Image

    (root / "annotations").mkdir()
    colours = {1: (255, 0, 0), 2: (0, 255, 0), 3: (0, 0, 255)}
    for split, content in annotations_by_split.items():
        (root / split).mkdir()
        for image in content["images"]:
            colour = colours[image["id"] % 3 + 1] if isinstance(image["id"], int) else (0, 0, 0)
            Image.new("RGB", (10, 6), colour).save(root / split / image["file_name"], format="PNG")
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(content))


def coco_json(image_ids, pairs):
    return {
        "images": [{"id": i, "file_name": f"COCO_{i:012d}.jpg"} for i in image_ids],
        "annotations": [{"image_id": i, "category_id": c, "bbox": [0, 0, 1, 1]} for i, c in pairs],
        "categories": [
            {"id": 1, "name": "person"},
            {"id": 3, "name": "car"},
            {"id": 90, "name": "toothbrush"},
        ],
    }


def test_coco_multi_hot_labels_and_images(tmp_path):
    train = coco_json([5, 2, 9], [(2, 1), (2, 90), (5, 3), (5, 3)])  # image 9: no annotation
    val = coco_json([7], [(7, 90)])
    _write_coco(tmp_path, {"train2014": train, "val2014": val})
    data = load_coco(str(tmp_path), 0, image_size=8)
    assert data.num_classes == 3
    # images sorted by id (2, 5); 9 has no label and is dropped; categories ordered 1, 3, 90
    np.testing.assert_array_equal(data.train_y, [[1, 0, 1], [0, 1, 0]])
    np.testing.assert_array_equal(data.test_y, [[0, 0, 1]])
    assert data.train_x.shape == (2, 3, 8, 8) and data.train_x.dtype == np.float32
    # image 2 is pure blue (id % 3 + 1 = 3): normalised with ImageNet statistics
    np.testing.assert_allclose(
        data.train_x[0, :, 0, 0],
        [-0.485 / 0.229, -0.456 / 0.224, (1 - 0.406) / 0.225],
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda c: c["annotations"][1].pop("category_id"),
            "'annotations\\[1\\].category_id' is missing",
        ),
        (
            lambda c: c["annotations"][0].update(category_id=77),
            "'annotations\\[0\\].category_id' = 77 is not in 'categories'",
        ),
        (lambda c: c["images"][0].update(id="x"), "'images\\[0\\].id' has the wrong type"),
        (lambda c: c.pop("categories"), "field 'categories' is missing"),
    ],
)
def test_malformed_coco_names_file_and_field(tmp_path, mutate, message):
    train = coco_json([1, 2], [(1, 1), (2, 3)])
    mutate(train)
    _write_coco(tmp_path, {"train2014": train, "val2014": coco_json([4], [(4, 1)])})
    with pytest.raises(DataError, match="instances_train2014.json: .*" + message):
        load_coco(str(tmp_path), 0, image_size=8)


def test_coco_invalid_json_names_line(tmp_path):
    _write_coco(
        tmp_path, {"train2014": coco_json([1], [(1, 1)]), "val2014": coco_json([4], [(4, 1)])}
    )
    (tmp_path / "annotations" / "instances_val2014.json").write_text(
        '{"images": [\n  {"id": 1,,}]}'
    )
    with pytest.raises(DataError, match="instances_val2014.json: invalid JSON at line 2"):
        load_coco(str(tmp_path), 0, image_size=8)


def test_synthetic_multilabel_is_correlated_uneven_and_learnable():
    data = load_synthetic_multilabel(None, 0, num_samples=4000, num_test=1000)
    frequency = data.train_y.mean(axis=0)
    assert frequency.max() > 8 * frequency.min()  # uneven label frequencies
    assert data.train_y.sum(axis=1).min() >= 1  # every sample has a label
    correlation = np.corrcoef(data.train_y.T.astype(float))
    assert np.abs(correlation[~np.eye(20, dtype=bool)]).max() > 0.2  # labels co-occur
    # learnable: a linear model on the features beats chance mAP by far
    from sklearn.linear_model import LogisticRegression

    from raysim.metrics.multilabel import mean_average_precision

    scores = np.stack(
        [
            LogisticRegression(max_iter=200)
            .fit(data.train_x, data.train_y[:, label])
            .decision_function(data.test_x)
            for label in range(20)
        ],
        axis=1,
    )
    assert mean_average_precision(scores, data.test_y) > 0.6 > 3 * frequency.mean()
    same = load_synthetic_multilabel(None, 0, num_samples=4000, num_test=1000)
    np.testing.assert_array_equal(same.train_x, data.train_x)


def test_xc_text_files_as_dense_multilabel_data(tmp_path):
    from raysim.data.xc_datasets import load_xc_multilabel

    (tmp_path / "train.txt").write_text("3 4 3\n0,2 0:1.5 3:2\n1 1:1\n 2:0.5\n")
    (tmp_path / "test.txt").write_text("1 4 3\n2 0:1\n")
    data = load_xc_multilabel(str(tmp_path), 0)
    np.testing.assert_array_equal(data.train_y, [[1, 0, 1], [0, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(data.train_x[0], [1.5, 0, 0, 2])
    np.testing.assert_array_equal(data.test_y, [[0, 0, 1]])
    (tmp_path / "test.txt").write_text("1 4 3\n2 9:1\n")
    with pytest.raises(DataError, match="test.txt"):
        load_xc_multilabel(str(tmp_path), 0)
