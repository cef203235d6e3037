"""The algorithms florist runs, each one folder: `spec.py` (what both halves share: settings,
message types, record keys), `server.py` and `client.py` (the halves, which import the spec and
never each other), and at most one module of its own machinery. This list is the registry:
`--strategy`, the run config, the ClientApp's handlers and the report are built from it."""

from __future__ import annotations

from florist.algorithms.base import Spec
from florist.algorithms.fedattn.spec import FEDATTN
from florist.algorithms.fedavg.spec import FEDAVG, FEDAVG_FT
from florist.algorithms.knnper.spec import KNNPER
from florist.algorithms.local.spec import LOCAL
from florist.algorithms.pefll.spec import ODPFL, PEFLL
from florist.algorithms.perfedckt.spec import PERFED_CKT

SPECS: dict[str, Spec] = {s.name: s for s in (FEDAVG, FEDAVG_FT, LOCAL, KNNPER, PEFLL, ODPFL, PERFED_CKT, FEDATTN)}


def spec_of(name: str) -> Spec:
    if name not in SPECS:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(SPECS)}")
    return SPECS[name]
