"""Bad image files in a node's folder or a simulated dataset: all named in one refusal (not one per run), and with
`skip-bad-images` named in the node's log, also when the decoded data come from the cache."""

import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from florist.client import node as node_lib
from florist.common import datacache, folders, scenarios
from florist.config import RunConfig

BAD = ("train/a/cut.png", "train/b/junk.png", "test/a/cut.png")  # truncated, not an image, truncated


@pytest.fixture
def folder(tmp_path):
    """train/ and test/ with two classes of 8×8 PNGs; the `BAD` files among them."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in "ab":
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / split / c / f"{i}.png")
    for name in BAD:
        (tmp_path / name).write_bytes((tmp_path / name).parent.joinpath("0.png").read_bytes()[:60])
    (tmp_path / "train/b/junk.png").write_bytes(b"not an image")
    return tmp_path


def test_every_bad_file_is_named_in_one_refusal(folder):
    with pytest.raises(ValueError) as err:
        folders.decode_folder(folder)
    text = str(err.value)
    assert text.startswith(
        "3 bad image files (3: replace or remove the file; or set skip-bad-images=true to leave such"
    )
    assert "\n" not in text
    assert all(f"{folder / name}: cannot be read as an image (" in text for name in BAD)


def test_a_node_names_its_skipped_files_also_from_the_cache(folder, monkeypatch, caplog):
    cfg = RunConfig.from_mapping({"num-classes": 2, "skip-bad-images": True})
    for _ in range(2):  # decoded, then read back from the disk cache by a fresh process
        monkeypatch.setattr(datacache, "_MEMORY", {})
        monkeypatch.setattr(node_lib, "_DESCRIBED", set())
        caplog.clear()
        with caplog.at_level(logging.INFO, "flwr"):
            own = {"data-dir": str(folder)}
            data = node_lib._identity(own, cfg.for_node(own))[2]  # as a node's message parses it (it logs)
        assert data.skipped_images == 3 and set(data.skipped_files) == {str(folder / n) for n in BAD}
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"data {folder}:"))
        assert "of 3×8×8; classes {0 'a': 8, 1 'b': 8}; 3 bad image files left out: " in line
        assert all(str(folder / n) in line for n in BAD)


def test_a_simulated_client_keeps_its_skipped_files_names(folder, monkeypatch):
    cfg = RunConfig.from_mapping(
        {"dataset": str(folder), "partition": "iid", "num-classes": 2, "skip-bad-images": True}
    )
    for _ in range(2):  # decoded, then read back from the disk cache
        monkeypatch.setattr(datacache, "_MEMORY", {})
        data = scenarios.client_data(0, 1, cfg)
        assert data.skipped_images == 3 and {Path(f).name for f in data.skipped_files} == {"cut.png", "junk.png"}


def test_simulate_names_every_bad_file_of_both_splits_in_one_refusal(folder):
    cfg = RunConfig.from_mapping({"dataset": str(folder), "partition": "iid", "num-classes": 2})
    with pytest.raises(ValueError, match=r"^3 bad image files \(") as err:
        scenarios.client_data(0, 1, cfg)
    assert "\n" not in str(err.value) and str(err.value).count("cannot be read as an image") == 3


def test_simulate_refuses_the_bad_files_of_every_partition_at_once(folder, tmp_path, capsys):
    """Each partition is decoded on its own: refused one by one, a bad file of the second partition
    would surface only on the run after the first's are fixed."""
    from florist.cli import main

    extra = [f"train/{c}/bad{i}.png" for c in "ab" for i in range(3)]
    for name in extra:
        (folder / name).write_bytes(b"not an image")
    args = ["simulate", "--runtime", "in-process", "--dataset", str(folder), "--partition", "iid", "--rounds", "1"]
    args += ["--num-clients", "2", "--unseen-fraction", "0", "--results-dir", str(tmp_path / "out")]
    capsys.readouterr()
    assert main([*args, "--run-config", "num-classes=2 min-train-nodes=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"florist: error: {len(BAD) + len(extra)} bad image files (")
    assert all(f"{name}: cannot be read as an image" in err[0] for name in (*BAD, *extra))


def test_the_decoding_before_a_run_refuses_every_partitions_bad_files_together(monkeypatch):
    """Partition 0 clean (the preflight's shape passes), the others' bad files all in one refusal."""
    from florist.common.badfiles import BadImages
    from florist.runners import launch, simulation

    def decode(pid, num, cfg, report):
        if pid:
            raise BadImages([(f"p{pid}.png", "cannot be read", "replace it")])

    monkeypatch.setattr(simulation, "hub_client", decode)
    cfg = RunConfig.from_mapping({"dataset": "owner/name", "partition": "iid"})
    with pytest.raises(
        BadImages,
        match=r"^2 bad image files \(2: replace it; or set .*\): p1\.png: cannot be read; p2\.png: cannot be read$",
    ):
        simulation.decode_data(cfg, 3, launch.Events())


def test_a_refusal_of_many_files_starts_with_what_fixes_them_the_rarest_remedy_first(tmp_path):
    """194 images of other sizes and one truncated file: the line's start says that one setting fixes the
    194 and names the truncated file before them, where it came somewhere among 195 paths."""
    rng = np.random.default_rng(0)
    (tmp_path / "a").mkdir()
    for i in range(8):
        size = 8 if i < 3 else 9 + i % 3  # 8×8 the most common size, 3 of each larger one
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(tmp_path / "a" / f"{i}.png")
    (tmp_path / "a" / "cut.png").write_bytes((tmp_path / "a" / "0.png").read_bytes()[:60])
    with pytest.raises(ValueError) as err:
        folders.decode_folder(tmp_path)
    text = str(err.value)
    head = "6 bad image files (1: replace or remove the file; 5: set image-size=8,8 to resize every image; or set "
    assert text.startswith(head), text
    names = [part.split(": ")[0] for part in text.split("): ", 1)[1].split("; ")]
    assert names[0] == str(tmp_path / "a" / "cut.png") and len(names) == 6
