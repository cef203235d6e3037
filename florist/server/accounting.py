"""The server's privacy ledger under `dp` (docs/privacy.md#accounting): each noised round's rate q,
noise multiplier σ, the seen nodes q was taken over, and the chance that round clipped a noise
share, kept in the checkpoint. ε is composed over the recorded rounds, each at its own cost, so a
run resumed with other nodes adds its new rounds to what was spent, never recomputes the old ones
at the new rate (which made the reported ε fall on a resume with more nodes)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from florist.common import privacy

# What the ledger's sum assumes of every round; a resume that would change any of them is refused.
ASSUMED = ("mode", "relation", "delta", "clip", "seeded")


@dataclasses.dataclass
class Ledger:
    plan: privacy.Plan
    nodes: int  # the seen nodes this part of the run samples from
    rounds: list[list[float]] = dataclasses.field(default_factory=list)  # [q, σ, nodes, clip probability]

    def __len__(self) -> int:
        return len(self.rounds)

    def history(self) -> tuple[privacy.Round, ...]:
        return tuple((q, sigma) for q, sigma, *_ in self.rounds)

    def record(self, clip_probability: float = 0.0) -> None:
        """One more noised round at the plan's (q, σ); `clip_probability`: the chance its noise was
        clipped anywhere (`distributed`'s quantization range), which the guarantee's δ takes on."""
        self.rounds.append([self.plan.q, self.plan.sigma, float(self.nodes), clip_probability])

    def row(self, clipped: int | None = None) -> dict[str, Any]:
        """The last round's results fields: `Plan.row` over the ledger, and the guarantee's δ where
        a noise share may have been clipped: δ + (1 + e^ε)·P(clipped) (a mechanism that differs from
        the Gaussian one with probability p is (ε, δ + (1 + e^ε)p)-DP)."""
        out = self.plan.row(self.history(), clipped)
        if (p := sum(r[3] for r in self.rounds)) > 0 and out["dp_epsilon"] is not None:
            out["dp_delta"] = self.plan.delta + (1 + math.exp(min(out["dp_epsilon"], 700))) * p
        return out

    def stop_before(self) -> str:
        """Why the next round must not run: it would take the ledger past the cap ("" when it may)."""
        return self.plan.stop_before(self.history())

    def assumptions(self) -> dict[str, Any]:
        return {name: getattr(self.plan, name) for name in ASSUMED}

    def state(self) -> dict[str, Any]:
        return {
            "private_rounds": len(self),
            "dp_ledger": self.rounds,
            "dp_assumptions": self.assumptions(),
        }

    def load(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's ledger: its rounds, and its σ (a resume with other nodes must
        not recalibrate the rounds to come as if none were spent); a checkpoint without a ledger,
        or one that assumed another mechanism, is refused in one line."""
        count, ledger = int(state.get("private_rounds", 0)), state.get("dp_ledger")
        if ledger is None:
            if count:
                raise ValueError(
                    f"cannot resume: the checkpoint counts {count} noised rounds but keeps no per-round privacy "
                    "ledger (written by an older florist), so what they spent cannot be added up; start the run anew"
                )
            return
        was, mine = state.get("dp_assumptions", {}), self.assumptions()
        if differ := [f"{k} {was.get(k)!r} there, {v!r} here" for k, v in mine.items() if was.get(k) != v]:
            raise ValueError(f"cannot resume: the privacy accounting would change ({'; '.join(differ)})")
        self.rounds = [[float(x) for x in r] for r in ledger]
        if self.rounds:  # the rounds to come at the σ the run started with, never recalibrated
            self.plan = dataclasses.replace(self.plan, sigma=self.rounds[-1][1])
