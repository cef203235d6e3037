"""What `florist join` lets a box say about itself beyond its data: that it never trains
(`--unseen`), its caps and other node-config keys (`--node-config`), and to retry forever; and
what it refuses to let a box say, each in one line before anything connects."""

import pytest
from processes import labelled_folder

from florist.cli import main
from florist.config import parse_overrides
from florist.deploy.join import supernode_args


def _node_config(args: list[str]) -> dict:
    return parse_overrides(args[args.index("--node-config") + 1])


def test_unseen_caps_and_forever_reach_the_supernodes_command_line(tmp_path):
    common = {"root_certificates": None, "auth_key": None, "state_dir": None, "node_key": "box"}
    args = supernode_args(
        "10.0.0.5:9092",
        tmp_path,
        **common,
        max_wait_time=None,
        unseen=True,
        node_config={"node-max-steps": 500, "torch-threads": 2},
    )
    assert _node_config(args) == {
        "node-max-steps": 500,
        "torch-threads": 2,
        "data-dir": str(tmp_path),
        "node-key": "box",
        "unseen": True,
    }
    assert "--max-wait-time" not in args  # Flower's SuperNode then retries for as long as it runs
    bounded = supernode_args("10.0.0.5:9092", tmp_path, **common, max_wait_time=30.0)
    assert bounded[bounded.index("--max-wait-time") + 1] == "30.0" and "unseen" not in _node_config(bounded)


@pytest.mark.parametrize(
    "node_config, message",
    [
        ('data-dir="/elsewhere"', "--node-config data-dir: set it with --data-dir"),
        ("unseen=true", "--node-config unseen: set it with --unseen"),
        ("trusted-server=true", "--node-config trusted-server: a box never trusts another party's server"),
        ("node-max-steps=0", "node-config key 'node-max-steps' must be a number > 0, got 0"),
        ("node-max-stepz=10", "--node-config node-max-stepz: not a key a box sets; it may set "),
    ],
)
def test_what_a_box_may_not_say_is_refused_before_it_connects(tmp_path, capsys, node_config, message):
    data = labelled_folder(tmp_path / "data")
    code = main(
        ["join", "--superlink", "127.0.0.1:1", "--data-dir", str(data), "--insecure"]
        + ["--node-config", node_config, "--max-wait-time", "forever"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"florist: error: {message}"), err


def test_a_wait_time_is_seconds_or_forever(tmp_path, capsys):
    args = ["join", "--superlink", "127.0.0.1:1", "--data-dir", str(tmp_path), "--insecure", "--max-wait-time"]
    with pytest.raises(SystemExit) as stop:
        main([*args, "-5"])
    assert stop.value.code == 2 and "expected seconds > 0 or forever, got '-5'" in capsys.readouterr().err
