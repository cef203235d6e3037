"""A box installs florist without extras: no Ray (the `simulation` extra). What a box runs must
never import it, and the simulation runtime without it must stop in one line naming the fix.
Ray is hidden in a child interpreter, so the tests run in the dev environment, which has it."""

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every import of ray in this interpreter fails, as where it is not installed, and is recorded.
HIDE_RAY = textwrap.dedent(
    """
    import sys
    tried = []
    class HideRay:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "ray":
                tried.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, HideRay())
    """
)


def run_hidden(code: str, tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`code` after HIDE_RAY in a child interpreter; processes it starts find a ray that fails to import."""
    fake = tmp_path / "no-ray" / "ray"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('ray is hidden by the test')\n")
    env = os.environ | {"PYTHONPATH": str(fake.parent)}
    return subprocess.run(
        [sys.executable, "-c", HIDE_RAY + textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ray_is_the_simulation_extra():
    """The base install has Flower without Ray; `simulation` brings it, and `dev` (make env, CI) has it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "flwr==1.39.0" in project["dependencies"]
    assert not any("[simulation]" in d or d.startswith("ray") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert extras["simulation"] == ["flwr[simulation]==1.39.0"]
    assert any(d.startswith("florist[") and "simulation" in d for d in extras["dev"])


def test_a_box_runs_without_ray(tmp_path):
    """The warm executor's preload imports every module of florist (so every command a box runs,
    and the ClientApp); a simulation in-process needs no Ray either. Neither so much as tries."""
    done = run_hidden(
        """
        from florist.deploy.preloaded import PreloadedApp
        from florist.cli import main
        PreloadedApp.load("florist.apps.client:app")
        code = main(["simulate", "--runtime", "in-process", "--num-clients", "2", "--rounds", "1",
                     "--results-dir", "results"])
        print("tried:", tried)
        sys.exit(code)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "tried: []"
    assert (tmp_path / "results" / "results.json").is_file()


@pytest.mark.parametrize(
    "command",
    [
        ["simulate", "--num-clients", "2", "--rounds", "1", "--results-dir", "results"],
        ["compare", "--strategies", "fedavg", "--seeds", "1", "--num-clients", "2", "--rounds", "1", "--out", "out"],
    ],
    ids=["simulate", "compare"],
)
def test_simulation_runtime_without_ray_is_one_line(tmp_path, command):
    """Exit 2 and one line with both ways on, before any run starts (the children would find no Ray either)."""
    done = run_hidden(
        f"""
        sys.modules["ray"] = None  # not installed: find_spec says so too
        from florist.cli import main
        sys.exit(main({command + ["--runtime", "simulation"]!r}))
        """,
        tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    errors = [line for line in lines if line.startswith("florist: error: ")]
    assert errors == lines[-1:], done.stderr[-2000:]  # compare says which runs it starts first
    assert "needs Ray, which is not installed" in errors[0]
    assert "pip install 'florist[simulation]'" in errors[0] and "--runtime in-process" in errors[0]
    assert not list(tmp_path.rglob("results.json"))
    if command[0] == "simulate":
        assert done.stderr.count("\n") == 1, done.stderr  # nothing else on stderr
