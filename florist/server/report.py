"""The human report of a run: a markdown table like the papers' and two PNG plots."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from florist.common.metrics import summarize, weighted_mean


def number(value: float | None, fmt: str) -> str:
    """`value` formatted with `fmt`; "–" where there is none (None, or NaN: no client in a group)."""
    return "–" if value is None or value != value else format(value, fmt)


def pct(value: float | None) -> str:
    """A fraction as a percentage with one decimal."""
    return number(None if value is None else 100 * value, ".1f")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


# Per-client fields some strategies report beside `accuracy`, each summarized in its own row.
SECONDARY = {"global_accuracy": "  (global model)", "masked_accuracy": "  (masked to train classes)"}

# The columns of `summary_rows`, wherever the table is shown; those from `FIGURES` on are numbers (right-aligned).
SUMMARY_COLUMNS = ("strategy", "clients", "n", "mean acc. (%)", "bottom decile (%)")
FIGURES = 2


def summary_title(results: dict[str, Any]) -> str:
    """The table's title: strategy and partition, which a row does not say."""
    return f"florist · {results['strategy']} · {results['config']['partition']}"


def summary_text(results: dict[str, Any]) -> list[str]:
    """The summary table as plain lines with aligned columns, for a log (the ServerApp's, which
    `flwr run --stream` shows) where the CLI prints the same rows with rich."""
    rows = [SUMMARY_COLUMNS, *summary_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(SUMMARY_COLUMNS))]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if i >= FIGURES else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    header, *body = (line(row) for row in rows)
    return [summary_title(results), header, "  ".join("-" * w for w in widths), *body]


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(strategy, clients, n, mean %, bottom-decile %) for seen and unseen clients, plus a row
    for each `SECONDARY` field the clients carry (the global model's accuracy beside the
    personalized one; the accuracy with outputs masked to the train split's classes)."""
    rows = []
    for group, seen in (("seen", True), ("unseen", False)):
        s = results["summary"][group]
        rows.append(
            (
                results["strategy"],
                group,
                str(s["num_clients"]),
                pct(s["mean_accuracy"]),
                pct(s["bottom_decile_accuracy"]),
            )
        )
        for field, label in SECONDARY.items():
            clients = [c for c in results["clients"] if c["seen"] == seen and c.get(field) is not None]
            if clients:
                g = summarize([c[field] for c in clients], [c["num_test"] for c in clients])
                rows.append(
                    (label, group, str(g["num_clients"]), pct(g["mean_accuracy"]), pct(g["bottom_decile_accuracy"]))
                )
    return rows


def markdown(results: dict[str, Any], own_section: Sequence[str] = ()) -> str:
    """The report; `own_section` is the strategy's own part (its server half's `report`)."""
    cfg, rounds = results["config"], results["rounds"]
    lines = [
        f"# florist run: {results['strategy']}",
        "",
        f"Dataset `{cfg.get('dataset', 'digits')}`, partition `{cfg['partition']}`, "
        f"shift `{cfg.get('shift', 'none')}`, "
        f"model `{cfg.get('client-models') or cfg['model']}`, {plural(len(rounds), 'round')}, "
        f"seed {cfg['seed']}, unseen fraction {cfg['unseen-fraction']}.",
        "",
        "| " + " | ".join(SUMMARY_COLUMNS) + " |",
        "|" + "|".join("---:" if i >= FIGURES else "---" for i in range(len(SUMMARY_COLUMNS))) + "|",
        *("| " + " | ".join(row) + " |" for row in summary_rows(results)),
        "",
        *global_model_note(results),
        *best_round(results),
        *privacy_lines(results),
        f"Training time {sum(r['seconds'] for r in rounds):.1f} s; bytes up "
        f"{sum(r['bytes_up'] for r in rounds):,}, down {sum(r['bytes_down'] for r in rounds):,}.",
    ]
    if results.get("failures"):
        lines += ["", f"{plural(len(results['failures']), 'node failure')} left out of their rounds:", ""]
        lines += [
            f"- round {f['round']}, {f['node']}, `{f['message_type']}`: {f['reason']}" for f in results["failures"]
        ]
    lines += by_cluster(results) + exchange_times(results) + list(own_section)
    lines += [
        "",
        "![accuracy per round](accuracy_per_round.png)",
        "",
        "![per-client accuracy](client_accuracy.png)",
    ]
    return "\n".join(lines + data_section(results))


def data_section(results: dict[str, Any]) -> list[str]:
    """What the clients read, as each node said at discovery: the source, the classes and the image
    size (one line where all agree, one per group of nodes where they differ: nodes reading their
    own folders), and the bad image files each left out (`skip-bad-images`), the first of them by
    name, so a report says what its accuracy was measured on."""
    cfg, clients, groups = results["config"], results["clients"], results.get("data") or []
    size = f"resized to {cfg['image-size']}" if cfg.get("image-size") else "decoded at their own size"
    held = sum(c.get("num_train") or 0 for c in clients), sum(c.get("num_test") or 0 for c in clients)
    source = groups[0]["source"] if len(groups) == 1 else cfg.get("dataset", "digits")
    hold = f"{plural(len(clients), 'client')} hold {held[0]:,} training and {held[1]:,} test samples."
    lines = ["", "## Data", ""]
    if len(groups) > 1:
        lines += [f"The nodes' data differ, images {size}; {hold}", ""]
        lines += [f"- {_group_line(g)}" for g in groups] + [""]
    else:
        lines += [f"Source `{_shown(source)}`, {cfg.get('num-classes', 10)} classes, images {size}; {hold}", ""]
        lines += class_line(results.get("class_names"))
    skipped = [c for c in clients if c.get("skipped_images")]
    if not skipped:
        return lines + ["No image file was left out.", ""]
    lines += ["Bad image files left out (`skip-bad-images`; each node's log names them all):", ""]
    return lines + [f"- {c['client']}: {_skipped(c)}" for c in skipped] + [""]


def _group_line(group: dict[str, Any]) -> str:
    """One group of nodes that said the same of their data: source, input shape, classes, who."""
    who = group["clients"]
    nodes = ", ".join(who[:5]) + (f" and {len(who) - 5} more" if len(who) > 5 else "")
    shape = "×".join(map(str, group["input_shape"]))
    classes = class_line(group["class_names"])
    named = f"; {classes[0][:-1]}" if classes else ""
    return f"`{_shown(group['source'])}`, inputs {shape}{named}: {nodes}"


def _skipped(client: dict[str, Any]) -> str:
    """How many bad files a client left out, and the first of them as it named them."""
    count, files = client["skipped_images"], client.get("skipped_files") or []
    if not files:
        return plural(count, "file")
    more = f", and {count - len(files)} more" if count > len(files) else ""
    return f"{plural(count, 'file')}: " + ", ".join(f"`{_shown(f)}`" for f in files) + more


def _shown(text: str) -> str:
    """A node's text as it can stand between a report's backticks."""
    return str(text).replace("`", "'")


def class_line(names: list[str] | None, shown: int = 50) -> list[str]:
    """The classes by name, in label order (the first `shown`), where the data names them."""
    if not names:
        return []
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ["Classes: " + ", ".join(f"{c} `{_shown(name)}`" for c, name in enumerate(names[:shown])) + more + ".", ""]


def global_model_note(results: dict[str, Any]) -> list[str]:
    """Why the unseen clients' global-model row (FedAvg's own row, another strategy's `(global
    model)` row) can sit far below the seen one, even below chance: those clients never trained
    the global model, and on a skewed partition their classes may be ones the training clients
    hardly hold. Said where it happens, with how few test images the row rests on."""
    field = "accuracy" if results["strategy"] == "fedavg" else "global_accuracy"
    scored = [c for c in results["clients"] if c.get(field) is not None]
    groups = {seen: [c for c in scored if c["seen"] == seen] for seen in (True, False)}
    if not groups[True] or not groups[False]:
        return []
    seen, unseen = (weighted_mean([c[field] for c in g], [c["num_test"] for c in g]) for g in groups.values())
    chance = 1 / results["config"].get("num-classes", 10)
    if unseen >= chance and unseen >= seen / 2:
        return []
    row = "The unseen row" if field == "accuracy" else "The unseen clients' `(global model)` row"
    images = sum(c["num_test"] for c in groups[False])
    afterword = "" if field == "accuracy" else "; the personalized row is what such a client gets"
    return [
        f"{row} ({pct(unseen)}%, chance {pct(chance)}%; "
        f"{plural(len(groups[False]), 'client')}, {plural(images, 'test image')}) scores the shared model, "
        f"which they never trained, and which scores {pct(seen)}% on the clients that did: on a skewed partition "
        f"(`{results['config']['partition']}`) with few clients, their classes can be ones the training clients "
        f"hardly hold, which the shared model then seldom predicts{afterword}.",
        "",
    ]


def best_round(results: dict[str, Any]) -> list[str]:
    """The seen clients' mean accuracy at the best and the last evaluated round beside the
    table's final figure: papers often report the best round."""
    figures = results.get("round_accuracy") or {}
    if figures.get("best") is None:
        return []
    return [
        f"Seen clients' mean accuracy per evaluated round: best {pct(figures['best'])}% (round "
        f"{figures['best_round']}), last {pct(figures['last'])}% (round {figures['last_round']}); the table "
        "shows the final evaluation.",
        "",
    ]


def privacy_lines(results: dict[str, Any]) -> list[str]:
    """Under `dp`: the mechanism, σ, C and the ε spent after the last round (docs/privacy.md),
    the nodes' record-level ε under `dp = "record"`, and why training stopped early when a budget
    stopped it."""
    rows = [r for r in results["rounds"] if "dp_noise_multiplier" in r]
    stopped = [f"Training stopped early: {results['stopped']}.", ""] if results.get("stopped") else []
    record = record_lines(results)
    if not rows:  # a budget may stop a run before its first round
        return record + stopped
    cfg, last = results["config"], rows[-1]
    mechanism, clip = f"`{cfg['dp']}`", cfg["dp-clip"]
    if str(cfg["dp"]).startswith("record+"):  # the user-level mechanism on top of DP-SGD, its own keys
        mechanism, clip = f"`{cfg['dp'].removeprefix('record+')}` (on top of record-level dp)", cfg["dp-user-clip"]
    spent = (
        f"ε = {last['dp_epsilon']:.3g} spent (δ = {cfg['dp-delta']:g}, {last.get('dp_accountant', 'rdp').upper()}, "
        f"{last.get('dp_relation', '')} neighbours)"
        if last.get("dp_epsilon") is not None
        else f"ε not reported, {last.get('dp_guarantee', 'no guarantee')}"
    )
    line = (
        f"Differential privacy {mechanism}: σ = {last['dp_noise_multiplier']:.4g}, C = {clip:g}; "
        f"{spent} after {plural(last['round'], 'round')}."
    )
    return [line, "", *record, *stopped]


def record_lines(results: dict[str, Any]) -> list[str]:
    """Under record-level dp: C and δ, and each node's ε after its last DP-SGD step (its own ledger's:
    the largest and smallest, and by node where the clients' rows name them)."""
    rows = [r for r in results["rounds"] if "dp_record_epsilon" in r]
    cfg = results["config"]
    if not rows:
        return []
    last = rows[-1]
    head = (
        f"Record-level differential privacy (DP-SGD on every node, {last.get('dp_record_relation', '')} neighbours): "
        f"C = {cfg['dp-clip']:g} per record's gradient, δ = {cfg['dp-delta']:g}"
    )
    if last.get("dp_record_guarantee"):
        return [f"{head}; ε not reported, {last['dp_record_guarantee']}.", ""]
    nodes = {c["client"]: c["dp_record_epsilon"] for c in results["clients"] if c.get("dp_record_epsilon") is not None}
    if not nodes:  # the final evaluation not done (or the sample private): what the rounds said
        nodes = {k: v["epsilon"] for r in rows for k, v in r.get("dp_record_nodes", {}).items() if "epsilon" in v}
    spent = [r["dp_record_epsilon"] for r in rows if r["dp_record_epsilon"] is not None]
    if not spent and not nodes:
        return [f"{head}; no node took a DP-SGD step.", ""]
    largest = max([*spent, *nodes.values()])
    cap = "∞" if cfg.get("dp-epsilon") is None else f"{cfg['dp-epsilon']:g}"  # results.json writes inf as null
    line = f"{head}; after {plural(last['round'], 'round')} the largest ε a node spent is {largest:.3g}"
    if nodes:
        line += f", the smallest {min(nodes.values()):.3g} (dp-epsilon {cap})."
        shown = ", ".join(f"{key} {eps:.3g}" for key, eps in sorted(nodes.items()))
        return [line, "", f"ε per node: {shown}.", ""]
    return [line + f" (dp-epsilon {cap}).", ""]


def by_cluster(results: dict[str, Any]) -> list[str]:
    """Accuracy per cluster of a shift scenario: a strategy that fits only the largest
    cluster shows here, where the overall mean would hide it."""
    clients = [c for c in results["clients"] if c.get("shift_cluster") is not None and c["accuracy"] is not None]
    if not clients:
        return []
    lines = [
        "",
        f"Accuracy per cluster of shift `{results['config']['shift']}`:",
        "",
        "| cluster | seen clients | seen mean (%) | unseen clients | unseen mean (%) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for cluster in sorted({c["shift_cluster"] for c in clients}):
        cells = []
        for seen in (True, False):
            rows = [c for c in clients if c["shift_cluster"] == cluster and c["seen"] == seen]
            s = summarize([c["accuracy"] for c in rows], [c["num_test"] for c in rows])
            cells += [str(s["num_clients"]), pct(s["mean_accuracy"])]
        lines.append(f"| {cluster} | " + " | ".join(cells) + " |")
    return lines


def exchange_times(results: dict[str, Any]) -> list[str]:
    """Where a round's time goes: per message type, the median exchange time, the slowest
    node's handler time, and the difference (what the runtime adds: polling, transfers,
    process start)."""
    by_type: dict[str, list[dict[str, Any]]] = {}
    for row in results["rounds"]:
        for exchange in row.get("exchanges", []):
            by_type.setdefault(exchange["type"], []).append(exchange)
    if not by_type:
        return []
    lines = [
        "",
        "Exchanges per round (medians over rounds, seconds):",
        "",
        "| message type | exchanges | nodes | exchange | slowest handler | overhead |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, rows in by_type.items():
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        overhead = statistics.median(r["seconds"] - r["handler_seconds_max"] for r in rows)
        lines.append(
            f"| `{kind}` | {len(rows)} | {med('nodes'):g} | {med('seconds'):.2f} | "
            f"{med('handler_seconds_max'):.2f} | {overhead:.2f} |"
        )
    return lines


def write_report(results: dict[str, Any], folder: Path, section: Callable[..., list[str]] | None = None) -> None:
    """report.md (with the strategy's own `section(results, folder)`) and the plots."""
    own_section = section(results, folder) if section else []
    (folder / "report.md").write_text(markdown(results, own_section))
    for name, figure in (("accuracy_per_round", accuracy_figure), ("client_accuracy", client_figure)):
        save(figure(results), folder / f"{name}.png")


def pyplot():
    """matplotlib's pyplot without a display (plots are files here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def accuracy_figure(results: dict[str, Any]):
    """Seen clients' mean accuracy per evaluated round, on a fixed 0-100 % axis (an auto-scaled
    one makes 96.5 -> 92.2 look like a collapse) with whole-round ticks; where the clients also
    report the global model's accuracy (kNN-Per, FedAvg+finetune), its line beside it."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    for field, label in (("accuracy", "personalized"), ("global_accuracy", "global model")):
        rows = [r for r in results["rounds"] if r.get(field) is not None]
        if rows:
            ax.plot([r["round"] for r in rows], [100 * r[field] for r in rows], marker=".", label=label)
    if len(ax.get_lines()) > 1:
        ax.legend()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="round", ylabel="seen-client mean accuracy (%)", ylim=(0, 100))
    ax.set_title(f"{results['strategy']}: accuracy per round")
    ax.grid(alpha=0.3)
    return fig


def client_figure(results: dict[str, Any]):
    """Every client's final accuracy as a dot over a box per group (seen, unseen)."""
    import numpy as np

    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    groups = [("seen", True), ("unseen", False)]
    data = [
        [100 * c["accuracy"] for c in results["clients"] if c["seen"] == s and c["accuracy"] is not None]
        for _, s in groups
    ]
    jitter = np.random.default_rng(0)  # spread the dots sideways: clients with equal scores stay visible
    for i, values in enumerate(data):
        ax.scatter(i + 1 + jitter.uniform(-0.12, 0.12, len(values)), values, alpha=0.6, s=14, zorder=3)
    ax.boxplot([v or [float("nan")] for v in data], showfliers=False)  # every client is a dot already
    ax.set_xticks([1, 2], [f"{name} ({len(v)})" for (name, _), v in zip(groups, data)])
    ax.set(ylabel="client test accuracy (%)", title=f"{results['strategy']}: per-client accuracy")
    ax.grid(alpha=0.3, axis="y")
    return fig
