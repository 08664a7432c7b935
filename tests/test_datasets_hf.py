"""The ``hf`` source (datasets/sources/hf.py) on small local files made here, with the network off:
parquet images, CSV tables, an image folder, a save_to_disk folder, and Hub names (cache or refusal)."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before Hugging Face datasets is first imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
hf = pytest.importorskip("datasets", reason="Hugging Face datasets (extra fl-platform[hf]) is not installed")
PIL = pytest.importorskip("PIL.Image")

from fl_platform.datasets.paths import DatasetNotFoundError  # noqa: E402
from fl_platform.datasets.registry import load_source  # noqa: E402
from fl_platform.experiment import build  # noqa: E402

from .conftest import compose_config  # noqa: E402

CLASSES = ["cat", "dog", "emu"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt fails the test: everything here is local."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] or kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _pixels(n: int, seed: int, shape=(8, 6, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def _image_set(pixels: np.ndarray, labels: list[int], mode: str = "RGB"):
    feats = hf.Features({"img": hf.Image(), "animal": hf.ClassLabel(names=CLASSES), "writer": hf.Value("string")})
    images = [PIL.fromarray(p, mode if p.ndim == 3 else "L") for p in pixels]
    writers = [f"w{i % 4}" for i in range(len(labels))]
    return hf.Dataset.from_dict({"img": images, "animal": labels, "writer": writers}, features=feats)


@pytest.fixture
def parquet(tmp_path):
    train_px, test_px = _pixels(30, 0), _pixels(9, 1)
    train_y, test_y = [i % 3 for i in range(30)], [i % 3 for i in range(9)]
    _image_set(train_px, train_y).to_parquet(tmp_path / "train.parquet")
    _image_set(test_px, test_y).to_parquet(tmp_path / "test.parquet")
    return tmp_path, train_px, test_px, np.array(train_y), np.array(test_y)


def test_local_parquet_images_load_offline(parquet):
    folder, train_px, test_px, train_y, test_y = parquet
    src = load_source("hf", path=str(folder / "train.parquet"), test_split=str(folder / "test.parquet"))
    assert src.input_shape == (3, 8, 6) and src.train_x.dtype == np.float32
    raw = train_px.transpose(0, 3, 1, 2).astype(np.float64) / 255
    mean, std = raw.mean(axis=(0, 2, 3)), raw.std(axis=(0, 2, 3))  # the training split's statistics
    want = (raw - mean[None, :, None, None]) / std[None, :, None, None]
    np.testing.assert_allclose(src.train_x, want, atol=2e-5)
    want_test = (test_px.transpose(0, 3, 1, 2) / 255 - mean[None, :, None, None]) / std[None, :, None, None]
    np.testing.assert_allclose(src.test_x, want_test, atol=2e-5)
    assert src.train_y.tolist() == train_y.tolist() and src.test_y.tolist() == test_y.tolist()
    assert src.num_classes == 3 and src.class_names == CLASSES
    np.testing.assert_allclose(src.pad_value, -mean / std, rtol=1e-5)  # a black pixel, standardised
    plain = load_source("hf", path=str(folder / "train.parquet"), test_split=str(folder / "test.parquet"),
                        normalize=False)
    np.testing.assert_allclose(plain.train_x, raw, atol=1e-7)
    assert plain.pad_value == (0.0, 0.0, 0.0)
    fixed = load_source("hf", path=str(folder / "train.parquet"), test_split=str(folder / "test.parquet"),
                        mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])
    np.testing.assert_allclose(fixed.train_x, (raw - 0.5) / 0.25, atol=1e-5)


def test_relative_paths_resolve_under_the_data_root(parquet):
    folder = parquet[0]
    src = load_source("hf", root=str(folder), path="train.parquet", test_split="test.parquet")
    assert src.num_train == 30 and src.num_test == 9


def test_test_fraction_is_a_fixed_stratified_split(parquet):
    folder = parquet[0]
    a = load_source("hf", path=str(folder / "train.parquet"), test_split=None, test_fraction=0.2, seed=0)
    b = load_source("hf", path=str(folder / "train.parquet"), test_split=None, test_fraction=0.2, seed=5)
    assert a.num_test == 6 and np.bincount(a.test_y).tolist() == [2, 2, 2]
    np.testing.assert_array_equal(a.test_x, b.test_x)  # the same test set whatever the run's seed
    c = load_source("hf", path=str(folder / "train.parquet"), test_split=None, test_fraction=0.4)
    assert c.num_test == 12


def test_grayscale_images_and_channels(tmp_path):
    px = _pixels(12, 2, shape=(5, 5))
    _image_set(px, [i % 3 for i in range(12)], mode="L").to_parquet(tmp_path / "g.parquet")
    gray = load_source("hf", path=str(tmp_path / "g.parquet"), test_split=None, test_fraction=0.25, normalize=False)
    assert gray.input_shape == (1, 5, 5)
    rgb = load_source("hf", path=str(tmp_path / "g.parquet"), test_split=None, test_fraction=0.25, normalize=False,
                      channels=3)
    assert rgb.input_shape == (3, 5, 5)
    np.testing.assert_array_equal(rgb.train_x[:, 0], gray.train_x[:, 0])
    np.testing.assert_array_equal(rgb.train_x[:, 2], gray.train_x[:, 0])


def test_columns_are_chosen_or_named(parquet):
    folder = parquet[0]
    opts = {"path": str(folder / "train.parquet"), "test_split": str(folder / "test.parquet")}
    by_name = load_source("hf", image_column="img", label_column="animal", **opts)
    auto = load_source("hf", **opts)
    np.testing.assert_array_equal(by_name.train_x, auto.train_x)
    writers = load_source("hf", label_column="writer", **opts)  # strings: numbered in sorted order
    assert writers.class_names == ["w0", "w1", "w2", "w3"] and writers.train_y[:5].tolist() == [0, 1, 2, 3, 0]
    grouped = load_source("hf", group_column="writer", **opts)
    assert grouped.group_names == ["w0", "w1", "w2", "w3"] and grouped.train_groups[:5].tolist() == [0, 1, 2, 3, 0]
    with pytest.raises(ValueError, match=r"dataset\.label_column='species' is not a column"):
        load_source("hf", label_column="species", **opts)
    with pytest.raises(ValueError, match=r"dataset\.image_column='writer' holds"):
        load_source("hf", image_column="writer", **opts)


def test_csv_table_with_string_labels_and_groups(tmp_path):
    rng = np.random.default_rng(3)
    rows = ["a,b,kind,device"] + [f"{rng.normal():.4f},{rng.normal() * 3 + 1:.4f},{'xy'[i % 2]},{i % 5}"
                                  for i in range(40)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    src = load_source("hf", path=str(tmp_path / "t.csv"), test_split=None, test_fraction=0.25,
                      label_column="kind", group_column="device")
    assert src.input_shape == (2,) and src.class_names == ["x", "y"] and src.num_classes == 2
    np.testing.assert_allclose(src.train_x.mean(axis=0), 0, atol=1e-5)  # standardised per feature
    np.testing.assert_allclose(src.train_x.std(axis=0), 1, atol=1e-4)
    assert src.num_groups == 5 and src.pad_value is None
    one = load_source("hf", path=str(tmp_path / "t.csv"), test_split=None, test_fraction=0.25,
                      label_column="kind", feature_columns=["b"], normalize=False)
    assert one.input_shape == (1,) and float(one.train_x.mean()) > 0.3  # column b, unstandardised
    with pytest.raises(ValueError, match="channels applies to image data"):
        load_source("hf", path=str(tmp_path / "t.csv"), test_split=None, test_fraction=0.25, label_column="kind",
                    channels=1)


def _csv(path, lines: list[str]) -> str:
    path.write_text("\n".join(["f1,f2,label", *lines]) + "\n")
    return str(path)


def _rows(n: int, labels: str = "01") -> list[str]:
    return [f"{i * 0.1:.1f},{i % 3},{labels[i % len(labels)]}" for i in range(n)]


def test_csv_rows_without_a_label_are_refused_naming_the_file(tmp_path):
    path = _csv(tmp_path / "t.csv", [*_rows(20), "0.5,1,", "0.6,2,"])
    with pytest.raises(ValueError, match=r"t\.csv: 2 of 22 row\(s\) have no label in column 'label' \(first: row 20"):
        load_source("hf", path=path, test_split=None, test_fraction=0.25)
    words = _csv(tmp_path / "w.csv", [*_rows(20, "xy"), "0.5,1,"])  # string labels: no class 'nan' or 'None'
    with pytest.raises(ValueError, match=r"w\.csv: 1 of 21 row\(s\) have no label"):
        load_source("hf", path=words, test_split=None, test_fraction=0.25)


@pytest.mark.parametrize("labels, test_label, message", [
    ("01", "7", r"te\.csv: test_y holds class id\(s\) 7 outside the training labels' range 0\.\.1"),
    ("xy", "zebra", r"te\.csv: test_y holds class id\(s\) 2 \('zebra'\) outside the training labels' range 0\.\.1"),
])
def test_a_test_class_that_train_lacks_is_refused(tmp_path, labels, test_label, message):
    train = _csv(tmp_path / "tr.csv", _rows(20, labels))
    test = _csv(tmp_path / "te.csv", [f"0.1,1,{labels[0]}", f"0.2,1,{test_label}"])
    with pytest.raises(ValueError, match=message):
        load_source("hf", path=train, test_split=test)
    _csv(tmp_path / "te.csv", [f"0.1,1,{labels[0]}", f"0.2,1,{labels[1]}"])
    assert load_source("hf", path=train, test_split=test).num_classes == 2


def test_a_test_file_lacking_a_column_is_refused_not_filled(tmp_path):
    train = _csv(tmp_path / "tr.csv", _rows(20))
    (tmp_path / "te.csv").write_text("f1,label\n0.1,0\n")
    with pytest.raises(ValueError, match=r"the test split .*te\.csv lacks column\(s\) f2"):
        load_source("hf", path=train, test_split=str(tmp_path / "te.csv"))


def test_a_feature_cell_that_is_empty_is_named_by_its_row_before_standardising(tmp_path):
    path = _csv(tmp_path / "t.csv", [*_rows(12), ",1,0", *_rows(8)])
    with pytest.raises(ValueError, match=r"t\.csv: train_x has non-finite values \(NaN or inf\) in 1 row\(s\), first row 12"):
        load_source("hf", path=path, test_split=None, test_fraction=0.25)


def test_a_non_numeric_column_left_out_of_the_features_is_logged(tmp_path, caplog):
    path = _csv(tmp_path / "t.csv", [*_rows(20), "abc,1,0"])
    with caplog.at_level("WARNING", logger="fl_platform.datasets.sources.hf"):
        src = load_source("hf", path=path, test_split=None, test_fraction=0.25)
    assert src.input_shape == (1,)
    assert "feature columns 'f1' (Value('large_string')) are not numeric, left out of the features (using f2)" \
        in caplog.text


def test_image_folder_and_save_to_disk_folder(tmp_path):
    images = tmp_path / "imgs"
    for split, n in (("train", 6), ("test", 3)):
        for c in CLASSES[:2]:
            (images / split / c).mkdir(parents=True)
            for i, p in enumerate(_pixels(n, hash((split, c)) % 1000, shape=(4, 4, 3))):
                PIL.fromarray(p).save(images / split / c / f"{i}.png")
    src = load_source("hf", path=str(images))
    assert src.num_train == 12 and src.num_test == 6 and src.input_shape == (3, 4, 4)
    assert src.class_names == ["cat", "dog"] and np.bincount(src.train_y).tolist() == [6, 6]
    saved = tmp_path / "saved"
    hf.DatasetDict({"train": _image_set(_pixels(9, 4), [0, 1, 2] * 3),
                    "valid": _image_set(_pixels(3, 5), [0, 1, 2])}).save_to_disk(str(saved))
    src = load_source("hf", path=str(saved), test_split="valid")
    assert (src.num_train, src.num_test) == (9, 3)
    with pytest.raises(ValueError, match=r"has no split 'test'; its splits: train, valid"):
        load_source("hf", path=str(saved))


def test_bad_settings_are_refused(parquet, tmp_path):
    folder = parquet[0]
    train, test = str(folder / "train.parquet"), str(folder / "test.parquet")
    cases = [
        ({}, "dataset.path is required"),
        ({"path": train, "test_split": test, "test_fraction": 0.2}, "exactly one of dataset.test_split"),
        ({"path": train}, "dataset.test_split must name the test file"),
        ({"path": train, "test_split": test, "revision": "main"}, "revision='main' pins a Hugging Face Hub version"),
        ({"path": train, "test_split": test, "split": "validation"}, "is the training split"),
        ({"path": train, "test_split": test, "subset": "x"}, "a single file has no subsets"),
        ({"path": train, "test_split": test, "mean": [0.5] * 3}, "both dataset.mean and dataset.std"),
        ({"path": train, "test_split": test, "mean": [0.5], "std": [0.2]}, "1/1 values for 3 channels"),
        ({"path": train, "test_split": test, "normalize": False, "mean": [0.5] * 3, "std": [0.2] * 3},
         r"no effect with dataset\.normalize=false"),
        ({"path": train, "test_split": test, "channels": 2}, "dataset.channels must be 1, 3"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            load_source("hf", **options)
    ragged = [PIL.fromarray(_pixels(1, 6, (4, 4, 3))[0]), PIL.fromarray(_pixels(1, 7, (5, 4, 3))[0])]
    hf.Dataset.from_dict({"image": ragged, "label": [0, 1]}).to_parquet(tmp_path / "r.parquet")
    with pytest.raises(ValueError, match=r"images differ in size \(row 0: \(4, 4\), row 1: \(5, 4\)\)"):
        load_source("hf", path=str(tmp_path / "r.parquet"), test_split=None, test_fraction=0.5)
    hf.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}).to_parquet(tmp_path / "text.parquet")
    with pytest.raises(ValueError, match="text is not supported"):
        load_source("hf", path=str(tmp_path / "text.parquet"), test_split=None, test_fraction=0.5)
    with pytest.raises(DatasetNotFoundError, match="is a local path, but nothing is there"):
        load_source("hf", path=str(tmp_path / "missing.parquet"), test_split=None, test_fraction=0.5)


def test_a_hub_name_is_read_from_the_cache_only_unless_download(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"dataset\.download=true"):
        load_source("hf", root=str(tmp_path), path="someone/not-cached", download=False)


def test_hub_options_reach_load_dataset_with_the_hub_off_unless_download(monkeypatch, tmp_path):
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs, hf.config.HF_HUB_OFFLINE))
        return _image_set(_pixels(6, 8), [0, 1, 2] * 2)

    monkeypatch.setattr(hf, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(hf.config, "HF_HUB_OFFLINE", False)
    for download in (False, True):
        load_source("hf", root=str(tmp_path), path="org/animals", subset="small", revision="v1", split="train[:6]",
                    test_split="test", download=download)
    assert [c[0] for c in calls] == ["org/animals"] * 4
    assert [c[1]["split"] for c in calls] == ["train[:6]", "test"] * 2
    assert all(c[1]["name"] == "small" and c[1]["revision"] == "v1" for c in calls)
    assert all(c[1]["cache_dir"] == str(tmp_path / "huggingface") for c in calls)
    assert [c[2] for c in calls] == [True, True, False, False]  # download=false: the Hub stays off
    assert hf.config.HF_HUB_OFFLINE is False  # restored


def test_hf_runs_as_an_experiment_with_augmentation(parquet):
    folder = parquet[0]
    cfg = compose_config("dataset=hf", f"dataset.path={folder / 'train.parquet'}",
                         f"dataset.test_split={folder / 'test.parquet'}", "dataset.augment.crop_padding=2",
                         "dataset.augment.hflip=true", "model=cnn", "model.channels=[2,2]", "model.hidden=4",
                         "num_clients=3", "clients_per_round=3", "rounds=1", "partition=iid", "train.batch_size=8",
                         "save_model=false", "engine.threads_per_worker=1")
    exp = build(cfg)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    assert exp.data.augment is not None and exp.data.augment.fill == pytest.approx(
        load_source("hf", path=str(folder / "train.parquet"), test_split=str(folder / "test.parquet")).pad_value)
    assert exp.data.input_shape == (3, 8, 6) and exp.data.num_clients == 3
    assert exp.simulation.history and "test_accuracy" in exp.simulation.history[-1]


def test_a_test_fraction_that_leaves_no_test_rows_is_refused(tmp_path):
    path = _csv(tmp_path / "few.csv", _rows(3))
    with pytest.raises(ValueError, match=r"hf:.*few\.csv: the test set is empty \(0 rows\)"):
        load_source("hf", path=path, test_split=None, test_fraction=0.25)


def test_unreadable_or_empty_local_files_are_refused_naming_the_file(tmp_path):
    hf.Dataset.from_dict({"f1": [float(i) for i in range(20)], "label": [i % 2 for i in range(20)]}).to_parquet(
        tmp_path / "ok.parquet")
    whole = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"hf: \S*cut\.parquet: not a readable parquet file: ArrowInvalid: "):
        load_source("hf", path=str(tmp_path / "cut.parquet"), test_split=None, test_fraction=0.25)
    with pytest.raises(ValueError, match=r"hf: \S*cut\.parquet: not a readable parquet file"):  # as the test file
        load_source("hf", path=str(tmp_path / "ok.parquet"), test_split=str(tmp_path / "cut.parquet"))
    hf.Dataset.from_dict({"f1": [1.0], "label": [0]}).select([]).to_parquet(tmp_path / "none.parquet")
    with pytest.raises(ValueError, match=r"hf: \S*none\.parquet: no rows"):
        load_source("hf", path=str(tmp_path / "none.parquet"), test_split=None, test_fraction=0.25)
    header = _csv(tmp_path / "header.csv", [])
    with pytest.raises(ValueError, match=r"hf: \S*header\.csv: no rows"):
        load_source("hf", path=header, test_split=None, test_fraction=0.25)
    with pytest.raises(ValueError, match=r"hf: \S*header\.csv: no rows .* the test file needs data"):
        load_source("hf", path=_csv(tmp_path / "tr.csv", _rows(8)), test_split=header)
    (tmp_path / "blank.csv").write_text("")
    with pytest.raises(ValueError, match=r"hf: \S*blank\.csv: not a readable CSV file: EmptyDataError"):
        load_source("hf", path=str(tmp_path / "blank.csv"), test_split=None, test_fraction=0.25)


def test_csv_files_are_closed_after_reading(tmp_path):
    import gc
    import warnings

    train, test = _csv(tmp_path / "tr.csv", _rows(20)), _csv(tmp_path / "te.csv", _rows(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        src = load_source("hf", path=train, test_split=test)
        gc.collect()
    assert (src.num_train, src.num_test) == (20, 4)
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
