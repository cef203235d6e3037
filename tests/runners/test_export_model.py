"""`florist export`: a node's kept model, loaded with plain `torch.jit.load` in a process where
florist cannot be imported, gives the probabilities `florist predict` computes (kNN-Per's
mixture over its kept store included), after real in-process runs on digits."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from florist.cli import main
from florist.client import personal
from florist.client.node import node_data
from florist.config import RunConfig
from florist.runners.export import export, module_for
from florist.runners.inprocess import run_in_process
from florist.runners.predict import probabilities

RUNS = {
    "fedavg": {},
    "knnper": {},
    "perfed-ckt": {"client-models": "mlp,cnn-wide"},  # two architectures other than the default cnn
}

# Loads each model.pt given and writes its probabilities for the samples, with florist unimportable.
WITHOUT_FLORIST = textwrap.dedent(
    """
    import sys

    class NoFlorist:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "florist":
                raise ImportError("florist is not importable in this process")

    sys.meta_path.insert(0, NoFlorist())
    import numpy as np
    import torch

    samples, out, *models = sys.argv[1:]
    with np.load(samples) as archive:
        arrays = {name: archive[name] for name in archive.files}
    with torch.no_grad():
        probs = {name: torch.jit.load(path)(torch.from_numpy(arrays[name])) for name, path in zip(arrays, models)}
    np.savez(out, **{name: p.numpy() for name, p in probs.items()})
    assert not any(m.split(".")[0] == "florist" for m in sys.modules), "florist was imported"
    """
)


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """Each strategy run in process (2 rounds, 4 digits clients) with its own state root."""
    root = tmp_path_factory.mktemp("export")
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))  # where the nodes keep their models
        for strategy, extra in RUNS.items():
            values = {"strategy": strategy, "num-server-rounds": 2, "min-nodes": 4, "min-train-nodes": 2}
            values |= extra | {"results-dir": str(root / strategy)}
            runs[strategy] = run_in_process(RunConfig.from_mapping(values), 4)["run_id"]
    return root / "cache" / "florist" / "nodes", runs


def kept_of(root, run_id) -> list[personal.Kept]:
    """Every model a node kept in run `run_id` (PerFed-CKT scores only the nodes that own a model)."""
    keys = [f"partition-{i}" for i in range(4)]
    return [personal.find(root, key, run_id) for key in keys if (root / key / personal.MODELS / str(run_id)).is_dir()]


@pytest.mark.parametrize("strategy", RUNS)
def test_an_export_predicts_as_florist_predict_without_florist(state, strategy, tmp_path):
    root, runs = state
    kept = [k for k in kept_of(root, runs[strategy]) if k.manifest["strategy"] == strategy]
    assert kept, f"no node kept a {strategy} model"
    samples, models = {}, []
    for k in kept:
        key = k.manifest["node_key"]
        cfg = RunConfig.from_mapping(k.manifest["run_config"])
        samples[key] = node_data(k.manifest["node_config"], cfg).x_test
        args = ["export", "--state-dir", str(root), "--node-key", key, "--run-id", str(runs[strategy])]
        assert main([*args, "--out", str(tmp_path / key)]) == 0
        models.append(str(tmp_path / key / "model.pt"))
        manifest = json.loads((tmp_path / key / "manifest.json").read_text())
        assert manifest["export"]["format"] == "torchscript" and manifest["run_id"] == runs[strategy]
        assert manifest["export"]["input"]["shape"] == ["N", *k.input_shape]
    if strategy == "perfed-ckt":
        assert {k.manifest["model"] for k in kept} == {"mlp", "cnn-wide"}
    np.savez(tmp_path / "x.npz", **samples)
    command = [sys.executable, "-c", WITHOUT_FLORIST, str(tmp_path / "x.npz"), str(tmp_path / "p.npz"), *models]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    with np.load(tmp_path / "p.npz") as exported:
        for k in kept:
            key = k.manifest["node_key"]
            want, got = probabilities(k, samples[key]), exported[key]
            assert got.shape == want.shape and got.dtype == np.float32
            np.testing.assert_array_equal(got.argmax(1), want.argmax(1))
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
            if k.manifest["accuracy"] is not None:  # the very accuracy the run reported
                y = node_data(k.manifest["node_config"], RunConfig.from_mapping(k.manifest["run_config"])).y_test
                assert float((got.argmax(1) == y).mean()) == k.manifest["accuracy"]


@pytest.mark.parametrize(
    "knn",
    [
        {"kernel": "squared", "lambda": 1.0, "k": 10, "sigma": 3.0},
        {"kernel": "paper", "lambda": 1.0, "k": 5, "sigma": 0.1},
        {"kernel": "paper", "lambda": 0.7, "k": 100_000, "sigma": 10.0},  # more neighbours than stored: all of them
    ],
)
def test_the_modules_knn_math_is_knnpers(state, knn):
    """The module's torch restatement of `knn_proba` against kNN-Per's (FAISS search, numpy kernel)
    on one kept store, with the mixture weight on the kNN term."""
    root, runs = state
    kept = kept_of(root, runs["knnper"])[0]
    kept = dataclasses.replace(kept, manifest=kept.manifest | {"knn": kept.manifest["knn"] | knn})
    x = node_data(kept.manifest["node_config"], RunConfig.from_mapping(kept.manifest["run_config"])).x_test
    want = probabilities(kept, x)
    with torch.no_grad():
        got = module_for(kept)(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got.argmax(1), want.argmax(1))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_an_approximate_index_is_searched_exactly_and_says_so(state, tmp_path):
    root, runs = state
    kept = kept_of(root, runs["knnper"])[0]
    hnsw = dataclasses.replace(kept, manifest=kept.manifest | {"knn": kept.manifest["knn"] | {"index": "hnsw"}})
    export(hnsw, tmp_path)
    said = json.loads((tmp_path / "manifest.json").read_text())["export"]["knn_search"]
    assert said.startswith("exact") and "approximate hnsw index" in said


def test_uint8_images_are_scaled_as_training_scales_them(state):
    root, runs = state
    module = module_for(kept_of(root, runs["fedavg"])[0])
    images = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(module(images), module(images.float() / 255), rtol=0, atol=0)
        with pytest.raises(torch.jit.Error, match=r"expects N x \[1, 8, 8\]"):
            module(torch.zeros(2, 1, 8, 9))


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def test_what_a_user_gets_wrong_is_one_line(state, tmp_path, capsys):
    root, runs = state
    out = ["--out", str(tmp_path / "out")]
    assert main(["export", "--state-dir", str(tmp_path / "empty"), *out]) == 2
    assert "no node keeps a model there" in one_line(capsys)
    assert main(["export", "--state-dir", str(tmp_path / "empty"), "--node-key", "partition-0", *out]) == 2
    assert "keeps no model" in one_line(capsys)
    assert main(["export", "--state-dir", str(root), "--node-key", "../up", *out]) == 2
    assert "must be 1-128 characters" in one_line(capsys)
    assert main(["export", "--state-dir", str(root), *out]) == 2  # several nodes: which one?
    assert "--node-key names the node" in one_line(capsys)
    assert main(["export", "--state-dir", str(root), "--node-key", "partition-9", *out]) == 2
    assert "keeps no model" in (said := one_line(capsys)) and "nodes that do: partition-0, partition-1" in said
    assert main(["export", "--state-dir", str(root), "--node-key", "partition-0", "--run-id", "7", *out]) == 2
    assert "kept no model of run 7" in one_line(capsys)
    assert main(["export", "--model", str(tmp_path), *out]) == 2
    assert "no manifest.json" in one_line(capsys)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    kept = ["--state-dir", str(root), "--node-key", "partition-0"]
    assert main(["export", *kept, "--out", str(blocked / "out")]) == 2
    assert "cannot write the export there" in one_line(capsys)
    assert not list(tmp_path.glob("**/model.pt"))
    with pytest.raises(SystemExit) as usage:
        main(["export", *kept, "--run-id", str(runs["fedavg"]), "--model", str(tmp_path), *out])
    assert usage.value.code == 2 and "--model: not allowed with argument --run-id" in capsys.readouterr().err
