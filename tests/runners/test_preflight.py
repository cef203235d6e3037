"""What the preflight refuses before any work starts, in one line, and what it warns about."""

import numpy as np

from florist.cli import main
from florist.config import RunConfig
from florist.runners.preflight import LARGE_MODEL_BYTES, preflight


def _images(root, side: int, classes: int = 3, per_class: int = 20):
    """`per_class` random side×side RGB PNGs in each of `classes` class folders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return str(root)


def test_num_classes_below_the_embedded_labels_is_refused_before_the_run(tmp_path, capsys):
    args = ["simulate", "--runtime", "in-process", "--num-clients", "3", "--rounds", "1"]
    code = main([*args, "--results-dir", str(tmp_path / "r"), "--run-config", "num-classes=5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("florist: error: num-classes 5, but dataset 'digits' has labels up to 9")
    assert not (tmp_path / "r" / "results.json").exists()  # refused before the run: nothing written


def test_a_model_that_does_not_fit_the_images_is_refused_naming_what_fits(tmp_path, capsys):
    """The default cnn on 64×64 RGB images: refused in one line, not trained at 16.8 MB a round."""
    args = ["simulate", "--runtime", "in-process", "--num-clients", "3", "--rounds", "1"]
    code = main(
        [*args, "--results-dir", str(tmp_path / "r"), "--run-config", f"dataset='{_images(tmp_path / 'i', 64)}'"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1] == (
        "florist: error: model 'cnn' takes C×H×W, H and W from 8 to 32; got 3×64×64: "
        "use image-size=32,32 (image folders) or model=mobilenet_v2"
    )
    assert not (tmp_path / "r" / "results.json").exists()


def test_a_large_model_is_warned_about_with_the_bytes_it_sends_and_the_default_run_is_not(tmp_path):
    images = _images(tmp_path / "i", 32)
    wide = preflight(RunConfig.from_mapping({"dataset": images, "model": "cnn-wide"}), 3).warnings
    assert [w for w in wide if "MB" in w] == [
        "model 'cnn-wide' on 3×32×32 inputs is 16.9 MB of weights, which each client receives and returns every "
        "round (PerFed-CKT's clients send soft decisions instead): a smaller model or image-size sends less"
    ]
    assert not [w for w in preflight(RunConfig.from_mapping({"dataset": images}), 3).warnings if "MB" in w]  # 4.2 MB
    assert preflight(RunConfig.from_mapping({}), 20).warnings == []  # the default run: cnn on the digits, 0.3 MB


def test_the_docs_state_the_size_the_preflight_warns_above(tmp_path):
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    assert f"more than {LARGE_MODEL_BYTES // 10**6} MB of them is warned about" in " ".join(text.split())


def test_record_dp_at_a_small_batch_is_warned_about_with_the_recommended_settings():
    """DP-SGD's noise per step is σ·C/batch-size: at the default batch of 16 the preflight names the recipe."""
    from florist.runners.preflight import RECORD_RECIPE

    small = preflight(RunConfig.from_mapping({"dp": "record", "dp-epsilon": 8.0}), 4).warnings
    assert [w for w in small if "batch-size=64 lr=0.1 momentum=0.9 local-epochs=3" in w and "σ·dp-clip/batch-size" in w]
    recipe = {key: value for key, value in RECORD_RECIPE.items()}
    large = preflight(RunConfig.from_mapping({"dp": "record", "dp-epsilon": 8.0} | recipe), 4).warnings
    assert not [w for w in large if "batch-size" in w]
    assert not [w for w in preflight(RunConfig.from_mapping({}), 4).warnings if "batch-size" in w]


def test_fedavg_ft_fine_tuning_at_a_step_momentum_multiplies_is_warned_about_under_record_dp():
    """FedAvg+'s fine-tuning takes the run's momentum: finetune-lr 0.05 at momentum 0.9 steps as 0.5."""
    recipe = {"dp": "record", "dp-epsilon": 8.0, "batch-size": 64, "lr": 0.1, "momentum": 0.9, "local-epochs": 3}
    ft = {"strategy": "fedavg-ft"}
    warned = preflight(RunConfig.from_mapping(recipe | ft), 4).warnings
    assert [w for w in warned if "finetune-lr=0.005" in w and "momentum 0.9" in w]
    assert not preflight(RunConfig.from_mapping(recipe | ft | {"finetune-lr": 0.005}), 4).warnings
    assert not preflight(RunConfig.from_mapping(recipe | ft | {"momentum": 0.0}), 4).warnings
