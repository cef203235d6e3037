"""What the preflight refuses before any work starts, in one line."""

from florist.cli import main


def test_num_classes_below_the_embedded_labels_is_refused_before_the_run(tmp_path, capsys):
    args = ["simulate", "--runtime", "in-process", "--num-clients", "3", "--rounds", "1"]
    code = main([*args, "--results-dir", str(tmp_path / "r"), "--run-config", "num-classes=5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("florist: error: num-classes 5, but dataset 'digits' has labels up to 9")
    assert not (tmp_path / "r" / "results.json").exists()  # refused before the run: nothing written
