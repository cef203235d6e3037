"""Whether two `florist compare` folders hold the same results: per strategy and seed, every
client's accuracy, every round's train loss and accuracy, and the bytes up. For a
refactoring that must change nothing: run the same `florist compare` on the old checkout and
on the new one (in-process runtime, the same seeds), then

    python benchmarks/same_results.py OLD_OUT NEW_OUT

Prints one line per run and exits 1 when any differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fingerprint(results: dict) -> dict:
    """What a behaviour change would move (timings and paths are left out)."""
    clients = {
        c["client"]: (c["seen"], c["num_train"], c["num_test"], c["accuracy"], c["loss"]) for c in results["clients"]
    }
    # Not the bytes down: every request carries the run id, random per run as Flower's are, and its
    # varint takes a byte more or less from one run to the next.
    rounds = [(r["round"], r["train_loss"], r["accuracy"], r["bytes_up"]) for r in results["rounds"]]
    return {"clients": clients, "rounds": rounds, "failures": [f["reason"] for f in results.get("failures", [])]}


def main(old: Path, new: Path) -> int:
    runs = sorted(p.relative_to(old) for p in old.glob("*/seed*/results.json"))
    if not runs:
        print(f"no */seed*/results.json under {old}")
        return 1
    differ = 0
    for run in runs:
        a, b = (json.loads((root / run).read_text()) for root in (old, new))
        same = fingerprint(a) == fingerprint(b)
        differ += not same
        clients = len(a["clients"])
        print(f"{run.parent}: {'identical' if same else 'DIFFERENT'} ({clients} clients, {len(a['rounds'])} rounds)")
    print(f"{len(runs) - differ} of {len(runs)} runs identical")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
