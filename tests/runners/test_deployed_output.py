"""What `deploy-local` shows of a run (issue 54): its streamed log, plain in a file, and when the
run leaves no results.json the ServerApp's own words, never "the run failed (flwr run exited 0)":
`flwr run --stream` exits 0 when the ServerApp raised."""

import sys
from pathlib import Path

from florist.deploy.spawning import colours_for_terminals_only
from florist.runners.deployment import no_results, stream

LOG = "INFO :      Starting\nERROR :     florist: error: dataset '/x/myshapes': no such folder (a local folder)\n"
COLOURED = LOG.replace("INFO ", "\x1b[92mINFO \x1b[0m").replace("ERROR ", "\x1b[91mERROR \x1b[0m")


def test_the_stream_is_echoed_plain_to_a_file_and_the_servers_last_stop_kept(tmp_path, capfd):
    rc, error = stream([sys.executable, "-c", f"print({COLOURED!r}, end='')"], {}, tmp_path)
    assert (rc, error) == (0, "dataset '/x/myshapes': no such folder (a local folder)")
    assert capfd.readouterr().out == LOG


def test_the_federations_processes_log_plain_to_their_files(monkeypatch):
    from flwr.common.logger import console_handler

    monkeypatch.setattr(console_handler, "colored", True)
    colours_for_terminals_only()  # stderr is pytest's capture here, as a log file is a SuperNode's
    assert console_handler.colored is False


def test_a_stop_without_results_says_why_not_the_exit_status():
    said = no_results(0, "dataset '/x/myshapes': no such folder (a local folder)", Path("logs"))
    assert said == "dataset '/x/myshapes': no such folder (a local folder)"
    unexplained = no_results(0, None, Path("logs"))
    assert "exited 0" not in unexplained and "before it saved any results" in unexplained
    assert no_results(1, None, Path("logs")).startswith("`flwr run` exited 1: see its output above")
