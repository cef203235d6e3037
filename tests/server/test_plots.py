"""The plots say what the table says: whole-round ticks, a fixed 0-100 % axis, kNN-Per's global
model beside the personalized line (from a real in-process run), and compare's long scenario
title inside the figure. Read back from the figure objects."""

import pytest

from florist.config import RunConfig
from florist.runners.compare import figure as compare_figure
from florist.runners.inprocess import run_in_process
from florist.server.report import accuracy_figure, pyplot


def _rounds(accuracies):
    return [{"round": i + 1, "accuracy": a} for i, a in enumerate(accuracies)]


@pytest.mark.parametrize("count", [2, 3, 5])
def test_round_ticks_are_whole_rounds_and_the_axis_is_0_to_100(count):
    fig = accuracy_figure({"strategy": "fedavg", "rounds": _rounds([0.965, 0.922, 0.95, 0.96, 0.97][:count])})
    ax = fig.axes[0]
    fig.canvas.draw()
    shown = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert shown and all(float(t).is_integer() for t in shown), shown
    assert ax.get_ylim() == (0, 100)
    pyplot().close(fig)


def test_knnper_plots_the_global_models_line_beside_its_own(tmp_path):
    values = {"strategy": "knnper", "num-server-rounds": 2, "partition": "iid", "unseen-fraction": 0.0}
    results = run_in_process(RunConfig.from_mapping(values | {"results-dir": str(tmp_path)}), 3)
    assert all(0 < r["global_accuracy"] <= 1 for r in results["rounds"])
    ax = accuracy_figure(results).axes[0]
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines["global model"] == [100 * r["global_accuracy"] for r in results["rounds"]]
    assert lines["personalized"] == [100 * r["accuracy"] for r in results["rounds"]]
    assert (tmp_path / "accuracy_per_round.png").stat().st_size > 0


def test_a_strategy_without_a_global_model_has_one_line_and_no_legend():
    ax = accuracy_figure({"strategy": "local", "rounds": _rounds([0.5, 0.6])}).axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["personalized"] and ax.get_legend() is None


def test_compares_legend_covers_no_bar():
    row = {"seen_mean_accuracy": [0.99, None], "unseen_mean_accuracy": [0.98, None]}
    fig = compare_figure({"fedavg": row, "knnper": row}, "digits")
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend, axes, frame = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer), fig.bbox
    assert legend.x0 >= axes.x1 and legend.x1 <= frame.x1, (legend, axes, frame)  # beside the bars, in the figure
    pyplot().close(fig)


def test_compares_long_scenario_title_stays_inside_the_figure():
    scenario = "mnist, partition inner-dirichlet:0.01, shift rotate:4, model mobilenet_v2, 100 clients, 200 rounds"
    row = {"seen_mean_accuracy": [0.9, 0.01], "unseen_mean_accuracy": [0.8, None]}
    fig = compare_figure({"fedavg": row, "knnper": row}, scenario)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    title, frame = fig.axes[0].title.get_window_extent(renderer), fig.bbox
    assert frame.x0 <= title.x0 and title.x1 <= frame.x1 and title.y1 <= frame.y1, (title, frame)
    assert scenario.replace(" ", "") in fig.axes[0].get_title().replace("\n", "").replace(" ", "")
