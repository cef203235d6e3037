"""The README's screenshots of TensorBoard and MLflow showing a real florist run, taken with a
real headless browser, which also checks that the run's metrics are on the page.

    apt-get install chromium chromium-driver; pip install selenium==4.50.0   # not florist's
    florist compare --runtime in-process --strategies fedavg,knnper --seeds 1 --num-clients 10 \\
        --rounds 15 --track tensorboard,mlflow --out /tmp/shots
    python docs/screenshots.py /tmp/shots [--mlflow PATH/TO/mlflow] [--out docs/images]

FOLDER is a results or compare folder (its tensorboard/ and mlflow.db). `tensorboard` and
`mlflow ui` (the full `mlflow` package: by default the one on PATH) run on 127.0.0.1 as
children of this script and are stopped, by their process ids, when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

METRICS = ("train_loss", "accuracy")  # names the pages must show
SIZE = (1280, 860)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(command: list[str], port: int, log: Path) -> Iterator[str]:
    """`command` running until its page answers on `port` (60 s at most); stopped on exit."""
    quiet = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}  # nothing leaves this machine
    with log.open("wb") as out:
        child = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=os.environ | quiet
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(120):
            if child.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {child.returncode}; see {log}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url, timeout=2).close()
                break
            time.sleep(0.5)
        else:
            raise TimeoutError(f"{command[0]} did not answer on {url} in 60 s; see {log}")
        yield url
    finally:
        child.terminate()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={SIZE[0]},{SIZE[1]}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))


def shoot(driver, url: str, path: Path, close: tuple[str, ...] = (), search: str = "") -> None:
    """Load `url`, click the buttons labelled `close` (side panes), type `search` into the
    page's chart search box, wait until the page shows every name of METRICS (60 s at most),
    let the charts draw, and save a palette PNG (a fifth of a full-colour one's size)."""
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    wait = WebDriverWait(driver, 60)
    shown = lambda d: all(name in d.find_element(By.TAG_NAME, "body").text for name in METRICS)  # noqa: E731
    buttons = [(By.CSS_SELECTOR, f"button[aria-label='{label}']") for label in close]
    for button in buttons:
        wait.until(lambda d: d.find_elements(*button))
    time.sleep(3)
    for button in buttons:
        driver.find_element(*button).click()
    if search:
        driver.find_element(By.CSS_SELECTOR, "input[placeholder='Search metric charts']").send_keys(search)
    wait.until(shown, f"{url} does not show {', '.join(METRICS)}")
    time.sleep(3)
    driver.save_screenshot(str(path))
    Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)
    print(f"{path}: {path.stat().st_size // 1024} kB, shows {', '.join(METRICS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--mlflow", default=shutil.which("mlflow") or "mlflow", help="the full mlflow's command")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images")
    args = parser.parse_args()
    folder, loopback = args.folder.absolute(), ["--host", "127.0.0.1", "--port"]
    args.out.mkdir(parents=True, exist_ok=True)
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{folder / 'mlflow.db'}"
    experiment = MlflowClient(store).search_runs([e.experiment_id for e in MlflowClient(store).search_experiments()])
    driver = browser()
    try:
        port = free_port()
        tensorboard = [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(folder / "tensorboard")]
        with server([*tensorboard, *loopback, str(port)], port, folder / "tensorboard.log") as url:
            page = f"{url}?tagFilter=%5E(accuracy%7Ctrain_loss)%24#timeseries"  # ^(accuracy|train_loss)$
            shoot(driver, page, args.out / "tensorboard.png", close=("Close side pane",))
        port = free_port()
        mlflow = [args.mlflow, "ui", "--backend-store-uri", store, *loopback, str(port)]
        with server(mlflow, port, folder / "mlflow-ui.log") as url:  # the experiment's runs, charts side by side
            page = f"{url}#/experiments/{experiment[0].info.experiment_id}/runs?compareRunsMode=CHART"
            shoot(driver, page, args.out / "mlflow.png", ("Close", "Toggle sidebar"), "^(accuracy|train_loss)$")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
