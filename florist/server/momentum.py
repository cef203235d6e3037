"""Server momentum (FedAvgM: Hsu et al., *Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification*, 2019) for FedAvg's family: the round's aggregate is taken as
a pseudo-gradient, Δ_t = aggregate − sent, and the server steps v_t = β·v_{t−1} + Δ_t,
w_{t+1} = w_t + η·v_t (`server-momentum` β, `server-lr` η; β 0 and η 1 is plain FedAvg, which
then takes the aggregate itself, untouched). It reads only the released aggregate, so under
`dp = "central"` it is post-processing and spends no ε."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

State = Mapping[str, torch.Tensor]


class ServerMomentum:
    """The velocity v over rounds and the step that moves the global model along it."""

    def __init__(self, momentum: float, lr: float):
        self.momentum, self.lr = momentum, lr
        self.velocity: dict[str, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        """Whether the step changes anything: off at β 0 and η 1, so FedAvg stays bit for bit."""
        return self.momentum != 0.0 or self.lr != 1.0

    def step(self, sent: State, aggregate: State) -> dict[str, torch.Tensor]:
        """w + η·v after v ← β·v + (aggregate − w), w the model `sent`; a tensor that is not floating
        (BatchNorm's batch count) is the aggregate's."""
        out = {}
        for key, w in sent.items():
            if not w.is_floating_point():
                out[key] = aggregate[key].clone()
                continue
            delta = aggregate[key].to(w.dtype) - w
            velocity = self.momentum * self.velocity[key] + delta if key in self.velocity else delta
            self.velocity[key] = velocity
            out[key] = w + self.lr * velocity
        return out

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to go on with the same velocity (empty before the first step)."""
        return {"server_velocity": dict(self.velocity)} if self.active else {}

    def load(self, state: Mapping[str, Any]) -> None:
        self.velocity = dict(state.get("server_velocity", {}))
