"""Every strategy florist runs, by the name `strategy` and `--strategy` take. Adding one is its
folder under `florist/strategies/`, one line here, and its handlers and server half in
`client.py` and `server.py` beside this file (docs/adding-a-strategy.md)."""

from __future__ import annotations

from florist import config
from florist.common.spec import StrategySpec
from florist.strategies.fedattn.spec import FEDATTN
from florist.strategies.fedavg.spec import FEDAVG, FEDAVG_FT
from florist.strategies.knnper.spec import KNNPER
from florist.strategies.local.spec import LOCAL
from florist.strategies.pefll.spec import ODPFL, PEFLL
from florist.strategies.perfedckt.spec import PERFED_CKT

STRATEGIES: dict[str, StrategySpec] = {
    s.name: s for s in (FEDAVG, FEDAVG_FT, LOCAL, KNNPER, PEFLL, ODPFL, PERFED_CKT, FEDATTN)
}
config.use_sections(
    {name: spec.settings for name, spec in STRATEGIES.items()},
    {name: spec.record_gap for name, spec in STRATEGIES.items() if not spec.record_covered},
)
