"""What a user can get wrong on the command line ends in exit status 2 and one line (plus at
most a hint), before any work starts."""

import dataclasses
import signal
import subprocess
import sys

import numpy as np
import pytest

from florist.cli import main

BAD = {  # what the user typed (after `florist`) -> what the one line must say
    "partition without alpha": (["simulate", "--partition", "dirichlet"], "partition must be"),
    "unknown partition": (["simulate", "--partition", "foo:3"], "partition must be"),
    "alpha zero": (["simulate", "--partition", "dirichlet:0"], "got 'dirichlet:0'"),
    "K above the classes": (["simulate", "--partition", "pathological:11"], "1 <= K <= 10"),
    "unknown model": (["simulate", "--run-config", 'model="resnet"'], "unknown model 'resnet'"),
    "model for other images": (
        ["simulate", "--strategy", "pefll", "--run-config", 'model="mobilenet_v2"'],
        "model 'mobilenet_v2' takes 3×H×W, H and W 32 or more; got 1×8×8",
    ),
    "unknown shift": (["simulate", "--shift", "relabel"], "shift must be 'none', 'relabel:K' or 'rotate:K'"),
    "unknown dataset": (
        ["simulate", "--dataset", "cifar10"],
        "dataset must be 'digits', 'mnist5k', 'synthetic:ALPHA,BETA'",
    ),
    "synthetic into a CNN": (
        ["simulate", "--dataset", "synthetic:1,1"],
        "model 'cnn' takes C×H×W, H and W from 8 to 32; got 60: use model=mlp",
    ),
    "unknown strategy": (["simulate", "--run-config", 'strategy="knn"'], "unknown strategy 'knn'"),
    "unquoted string": (["simulate", "--run-config", "lr=abc"], "strings need quotes"),
    "commas": (["simulate", "--run-config", "lr=0.1,local-epochs=2"], "not commas"),
    "unknown key": (["simulate", "--run-config", "learning-rate=0.1"], "unknown run-config key 'learning-rate'"),
    "python-style key": (["simulate", "--run-config", "local_epochs=2"], "did you mean 'local-epochs'?"),
    "misspelled option": (["simulate", "--stratgy", "knnper"], "did you mean --strategy?"),
    "wrong type": (["simulate", "--run-config", 'lr="fast"'], "'lr' expects float"),
    "negative lr": (["simulate", "--run-config", "lr=-1.0"], "lr must be > 0"),
    "negative rounds": (["simulate", "--rounds", "-1"], "num-server-rounds must be >= 0"),
    "unseen fraction": (["simulate", "--unseen-fraction", "1.5"], "unseen-fraction must be in [0, 1)"),
    "no clients": (["simulate", "--num-clients", "0"], "expected a whole number >= 1"),
    "not a number": (["simulate", "--seed", "abc"], "invalid int value: 'abc'"),
    "fewer clients than min-nodes": (
        ["simulate", "--num-clients", "2", "--run-config", "min-nodes=3"],
        "min-nodes is 3",
    ),
    "unpartitionable": (["simulate", "--num-clients", "200", "--partition", "dirichlet:0.05"], "cannot partition"),
    "strategy setting": (
        ["simulate", "--strategy", "perfed-ckt", "--run-config", "ckt-clusters=0"],
        "ckt-clusters must be >= 1",
    ),
    "a client model": (
        ["simulate", "--strategy", "perfed-ckt", "--run-config", 'client-models="cnn,resnet"'],
        "unknown model 'resnet'",
    ),
    "results under a file": (["simulate", "--results-dir", "{file}/out"], "is a file, not a folder"),
    "results under /proc": (["simulate", "--results-dir", "/proc/florist-results"], "/proc refuses it"),
    "nothing to resume": (["simulate", "--resume", "{tmp}"], "checkpoint.pt does not exist"),
    "auth without tls": (["deploy-local", "--auth", "--results-dir", "{tmp}/d"], "needs TLS"),
    "deploy-local bad config": (["deploy-local", "--partition", "dirichlet"], "partition must be"),
    "unknown executor": (["deploy-local", "--executor", "cold"], "invalid choice: 'cold'"),
    "join address": (["join", "--superlink", "nohost", "--data-dir", "{tmp}"], "must be HOST:PORT"),
    "join data": (["join", "--superlink", "127.0.0.1:9", "--data-dir", "{tmp}/missing"], "does not exist"),
    "join CA file": (
        ["join", "--superlink", "127.0.0.1:9", "--data-dir", "{data}", "--root-certificates", "{tmp}/ca.crt"],
        "no such file",
    ),
    "no datastore yet": (["datastore", "add", "--node-key", "x", "--data-dir", "{data}"], "no kNN-Per datastore"),
    "public set": (["public-hash", "{tmp}/missing"], "does not exist"),
    "unknown command": (["comparison"], "invalid choice: 'comparison'"),
    "device form": (["simulate", "--run-config", 'device="gpu"'], "device must be 'auto'"),
    "absent device": (
        ["simulate", "--run-config", 'device="cuda:99"'],
        "device 'cuda:99' is not available on this machine",
    ),
    "absent server device": (
        ["simulate", "--strategy", "pefll", "--run-config", 'server-device="cuda:99"'],
        "server-device 'cuda:99' is not available",
    ),
    "join absent device": (
        ["join", "--superlink", "127.0.0.1:9", "--data-dir", "{data}", "--device", "cuda:99"],
        "--device 'cuda:99' is not available",
    ),
    "too many cpus": (["simulate", "--cpus-per-client", "999"], "--cpus-per-client must be in (0,"),
    "absent gpus": (["compare", "--out", "{tmp}/c", "--gpus-per-client", "9"], "torch sees"),
    "augment": (["simulate", "--run-config", 'augment="rotate"'], "augment must be one of none, flip, crop-flip"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_mistake_is_one_line_and_exit_status_2(case, tmp_path, capsys):
    args, expected = BAD[case]
    (tmp_path / "file").write_text("")
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        np.savez(data / f"{split}.npz", x=np.zeros((4, 1, 8, 8), np.float32), y=np.arange(4))
    args = [a.format(tmp=tmp_path, file=tmp_path / "file", data=data) for a in args]
    if "--results-dir" not in args and args[0] in ("simulate", "deploy-local"):
        args += ["--results-dir", str(tmp_path / "results")]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) <= 2 and "Traceback" not in err and expected in lines[0], err
    assert all(f"florist {args[0]} --help" in hint for hint in lines[1:] if args[0] != "comparison"), err
    assert not (tmp_path / "results" / "simulation.log").exists()  # refused before the simulation started


def test_a_real_process_prints_one_line_and_no_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "florist", "simulate", "--partition", "dirichlet", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "partition must be" in done.stderr


def test_a_ctrl_c_that_lands_in_exec_run_code_still_exits_130(tmp_path):
    """An interrupt during an import can land in code that `exec` runs; CPython then ended
    `python -m florist` by SIGINT although `main` had caught it (-2, not 130; seen under load)."""
    (tmp_path / "interrupted.py").write_text(
        "import sys\nfrom florist import cli\nfrom florist.cli import certs\n"
        "certs.run = lambda args: exec('raise KeyboardInterrupt')\n"
        f"sys.exit(cli.main(['certs', '--out', {str(tmp_path)!r}, '--hosts', 'localhost']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "interrupted"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 130 and done.stderr == "florist: interrupted\n", done.stderr


def test_version_and_help_promise_only_what_exists(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("florist ")
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "comparison" not in help_text and "compare" in help_text and "simulate" in help_text
    # simulate runs in this process too, on any dataset (issue 54: it said Flower's runtime, the digits)
    simulate = " ".join(help_text.split("\n    simulate ", 1)[1].split("\n    ", 2)[:2])
    assert "in this process" in simulate and "embedded digits" not in simulate, simulate


def test_a_strategys_commands_are_added_once_and_a_name_taken_twice_is_refused():
    import argparse

    from florist.apps.registry import STRATEGIES
    from florist.cli import add_strategy_commands

    knnper, ckt = STRATEGIES["knnper"], STRATEGIES["perfed-ckt"]
    sub = argparse.ArgumentParser().add_subparsers()
    add_strategy_commands(sub, [knnper, knnper, ckt])  # one function, declared by two specs: once
    assert list(sub.choices) == ["datastore", "public-hash"]
    twin = dataclasses.replace(ckt, name="twin", commands=lambda s: s.add_parser("datastore"))
    with pytest.raises(RuntimeError, match="strategy 'twin'.*conflicting subparser: datastore"):
        add_strategy_commands(argparse.ArgumentParser().add_subparsers(), [knnper, twin])


def test_a_class_only_held_out_clients_have_is_named_before_the_run(tmp_path):
    import re

    from florist.common import data
    from florist.config import RunConfig
    from florist.runners.preflight import check_run

    cfg = RunConfig.from_mapping({"partition": "pathological:2", "results-dir": str(tmp_path)})
    warnings = check_run(cfg, 10)
    assert warnings and check_run(cfg.replace(partition="iid"), 10) == []
    held_out = data.unseen_partitions(10, cfg.unseen_fraction, cfg.seed)
    clients = [
        data.embedded_client(
            i, 10, cfg.partition, cfg.seed, cfg.val_fraction, cfg.test_fraction, public_size=cfg.public_size
        )
        for i in range(10)
    ]
    trained = set().union(*(set(c.y_train) | set(c.y_val) for i, c in enumerate(clients) if i not in held_out))
    for warning in warnings:  # each names a digit no training client has, and the held-out clients that do
        digit, owners = re.match(r"digit (\d+) belongs only to held-out client\(s\) ([\d, ]+):", warning).groups()
        assert int(digit) not in trained
        assert {int(o) for o in owners.split(", ")} <= held_out


def test_a_larger_model_at_the_cnns_step_is_warned_about_before_the_run(tmp_path):
    """The default lr was tuned on the 8×8 cnn; LeNet diverged at it on some PeFLL nodes."""
    from florist.config import RunConfig
    from florist.runners.preflight import check_run

    cfg = RunConfig.from_mapping({"dataset": "mnist5k", "model": "lenet", "results-dir": str(tmp_path)})
    assert [w for w in check_run(cfg, 4) if "lr 0.2 is tuned for the 8×8 cnn" in w and "lr=0.1" in w]
    assert not [w for w in check_run(cfg.replace(lr=0.1), 4) if "tuned" in w]
    assert not [w for w in check_run(cfg.replace(model="cnn"), 4) if "tuned" in w]


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"strategy": "fedattn", "num-server-rounds": 3}, "fedattn-warmup 5 >= num-server-rounds 3"),
        ({"strategy": "fedattn", "num-server-rounds": 5}, "this run is FedAvg"),
        ({"strategy": "fedattn", "num-server-rounds": 6}, None),
        ({"strategy": "fedattn", "num-server-rounds": 3, "fedattn-warmup": 0}, None),
        ({"num-server-rounds": 0}, "num-server-rounds 0: nothing trains"),
        ({"num-server-rounds": 1}, None),
    ],
)
def test_a_run_too_short_for_its_strategy_is_warned_about_before_it_starts(tmp_path, values, expected):
    """FedAttn within its warm-up gave a table identical to FedAvg's with nothing said."""
    from florist.config import RunConfig
    from florist.runners.preflight import check_run

    warnings = check_run(RunConfig.from_mapping(values | {"results-dir": str(tmp_path)}), 4)
    found = [w for w in warnings if "num-server-rounds" in w]
    assert (found and expected in found[0]) if expected else not found, warnings


@pytest.mark.parametrize(
    "cores, flags, env, expected",
    [
        (2, [], {}, "in-process"),
        (16, [], {}, "simulation"),
        (2, ["--gpus-per-client", "0.5"], {}, "simulation"),
        (2, ["--ray-address", "10.0.0.1:6379"], {}, "simulation"),
        (2, [], {"FLORIST_RAY_ADDRESS": "10.0.0.1:6379"}, "simulation"),
        (2, ["--ray-address", ""], {"FLORIST_RAY_ADDRESS": "10.0.0.1:6379"}, "in-process"),
        (16, ["--runtime", "in-process"], {}, "in-process"),
        (2, ["--runtime", "simulation"], {}, "simulation"),
    ],
)
def test_the_default_runtime_suits_the_machine_and_the_flags(monkeypatch, cores, flags, env, expected):
    """In-process where Ray's start-up would be most of the run (a small machine, no GPU, no
    cluster); Flower's simulation where clients side by side, GPUs or a cluster pay for it."""
    from florist.cli import build_parser
    from florist.cli.options import chosen_runtime
    from florist.runners import simulation

    monkeypatch.setattr("os.cpu_count", lambda: cores)
    monkeypatch.setattr(simulation, "gpu_count", lambda: 0)
    monkeypatch.delenv("FLORIST_RAY_ADDRESS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for command in (["simulate"], ["compare", "--out", "cmp"]):
        assert chosen_runtime(build_parser().parse_args([*command, *flags])) == expected


def test_a_ctrl_c_before_the_run_starts_stops_a_florist_started_with_sigint_ignored(tmp_path):
    """A script's `florist ... &` starts it with SIGINT ignored: a Ctrl-C sent (by PID) during the
    preflight, before any round, was ignored and the run went on to its end."""
    (tmp_path / "preflight.py").write_text(
        "import signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from florist import cli\nfrom florist.cli import simulate\n"
        "simulate.run = lambda args: (print('ready', flush=True), time.sleep(60))\n"
        "sys.exit(cli.main(['simulate', '--results-dir', sys.argv[1]]))\n"
    )
    run = subprocess.Popen(
        [sys.executable, "-m", "preflight", str(tmp_path / "out")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stdout.readline() == "ready\n"
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=120)  # only ends a hung run: ignored, the command sleeps 60 s then exits 0
    finally:
        run.kill()
    assert run.returncode == 130 and err == "florist: interrupted\n", err
