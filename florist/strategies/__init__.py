"""The algorithms florist runs, each one folder: `spec.py` (what both halves share: settings,
message types, record keys), `server.py` and `client.py` (the halves, which import the spec and
never each other), and at most one module of its own machinery. This list is the registry:
`--strategy`, the run config, the ClientApp's handlers and the report are built from it."""

from __future__ import annotations

from florist.strategies.base import StrategySpec
from florist.strategies.fedattn.spec import FEDATTN
from florist.strategies.fedavg.spec import FEDAVG, FEDAVG_FT
from florist.strategies.knnper.spec import KNNPER
from florist.strategies.local.spec import LOCAL
from florist.strategies.pefll.spec import ODPFL, PEFLL
from florist.strategies.perfedckt.spec import PERFED_CKT

STRATEGIES: dict[str, StrategySpec] = {
    s.name: s for s in (FEDAVG, FEDAVG_FT, LOCAL, KNNPER, PEFLL, ODPFL, PERFED_CKT, FEDATTN)
}


def strategy_spec(name: str) -> StrategySpec:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]
