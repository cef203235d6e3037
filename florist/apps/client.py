"""florist's ClientApp (`[tool.flwr.app.components] clientapp`): every message type any strategy
declares, with the function that answers it. Search a message type (`train.knnper`) to find
its handler here, and go to the handler's definition from its line."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from flwr.clientapp import ClientApp

from florist.apps.registry import STRATEGIES
from florist.client import messages, personal
from florist.common.models import Net
from florist.common.spec import INFO, Exchange
from florist.strategies.fedattn import client as fedattn
from florist.strategies.fedavg import client as fedavg
from florist.strategies.fedavg import spec as fedavg_spec
from florist.strategies.knnper import client as knnper
from florist.strategies.local import client as local
from florist.strategies.pefll import client as pefll
from florist.strategies.perfedckt import client as perfedckt

__all__ = ["HANDLERS", "PREDICTORS", "app", "build_client_app", "exchanges", "warm_up"]
warm_up = messages.warm_up  # the warm executor finds it beside `app` and runs it once before forking

HANDLERS: dict[str, messages.Handler] = {
    "query.info": messages.info,  # every run's first message: the node's data sizes, shape, seen/unseen
    "train": fedavg.train,  # FedAvg, FedAvg+, and Flower's own strategies
    "evaluate": fedavg.evaluate,  # FedAvg, FedAvg+ (fine-tuned first), FedAttn
    # secure aggregation's stages (FedAvg, FedAvg+, kNN-Per's global model, FedAttn's G): each trains as its
    # own handler does
    "query.secagg_keys": fedavg.secagg_keys,
    "query.secagg_shares": fedavg.secagg_shares,
    "train.secagg": fedavg.secure_training(
        {"fedavg": fedavg.train, "fedavg-ft": fedavg.train, "knnper": knnper.train, "fedattn": fedattn.train}
    ),
    "query.secagg_unmask": fedavg.secagg_unmask,
    "train.local": local.train,
    "evaluate.local": local.evaluate,
    "train.knnper": knnper.train,
    "evaluate.knnper": knnper.evaluate,
    "query.describe": pefll.describe,  # PeFLL and OD-PFL
    "train.generated": pefll.train,
    "train.encoder": pefll.backprop,
    "evaluate.generated": pefll.evaluate,
    "train.ckt": perfedckt.train,
    "evaluate.ckt": perfedckt.evaluate,
    "train.attn": fedattn.train,
    "query.represent": fedattn.represent,
}

# What a node whose --node-config sets dp answers (florist/client/ledger.py): discovery (its sizes, stated as not
# private), training whose update local or distributed dp noises and its ledger counts, secure aggregation's
# stages (keys and shares, no data), and the evaluations docs/privacy.md states as not covered. Any other type
# (train.attn, query.represent, train.generated, train.ckt, ...) is refused in one line naming it.
BOUNDED_UNDER_NODE_DP = frozenset(
    {
        "query.info",
        "train",
        "train.knnper",
        "evaluate",
        "evaluate.knnper",
        *(e.message_type for e in fedavg_spec.SECAGG),
    }
)

# What a node under record-level dp answers (florist/client/ledger.py): every message whose reply derives from its
# data only through DP-SGD's steps (a model trained by them, post-processing of one, or a noised mean counted as a
# step: FedAttn's Z and bias gradient), or not at all; PeFLL's and OD-PFL's descriptor and encoder messages are not.
BOUNDED_UNDER_RECORD_DP = BOUNDED_UNDER_NODE_DP | {
    "train.local",
    "evaluate.local",
    "train.ckt",
    "evaluate.ckt",
    "train.attn",
    "query.represent",
}

# A kept model (`client/personal.py`) predicts with its network alone, unless its strategy is
# here: what else it scored with (kNN-Per: its datastore, mixed in).
PREDICTORS: dict[str, Callable[[personal.Kept, Net, np.ndarray], np.ndarray]] = {"knnper": knnper.personal_proba}


def exchanges() -> dict[str, Exchange]:
    """Every exchange any strategy declares, once by message type (strategies share some, e.g.
    FedAvg's `evaluate`), each with a handler in HANDLERS and no handler without one."""
    declared: dict[str, Exchange] = {INFO.message_type: INFO}
    for spec in STRATEGIES.values():
        for exchange in spec.exchanges:
            if declared.setdefault(exchange.message_type, exchange) != exchange:
                raise ValueError(f"message type {exchange.message_type!r} is declared twice, differently")
    if unanswered := sorted(set(declared) - set(HANDLERS)):
        raise ValueError(f"no handler in florist/apps/client.py for message type {unanswered[0]!r}")
    if undeclared := sorted(set(HANDLERS) - set(declared)):
        raise ValueError(f"a handler for message type {undeclared[0]!r}, which no strategy declares")
    return declared


def build_client_app(mods: Sequence[Callable] = ()) -> ClientApp:
    """florist's ClientApp with `mods` (Flower mods, run inside florist's own: e.g. a mod with
    parameters of its own, or a test's injected failure)."""
    handlers: Mapping[Exchange, messages.Handler] = {e: HANDLERS[t] for t, e in exchanges().items()}
    built = messages.build_client_app(
        handlers,
        STRATEGIES,
        mods,
        cls=RebuiltClientApp,
        bounded=BOUNDED_UNDER_NODE_DP,
        record_bounded=BOUNDED_UNDER_RECORD_DP,
    )
    built.mods_given = tuple(mods)
    return built


class RebuiltClientApp(ClientApp):
    """florist's ClientApp, which pickles as the call that builds it: its mods and this module's
    name. Flower's simulation sends the app with every message to a Ray worker; by value,
    cloudpickle would copy the handlers' closures without importing this module, so the worker
    would never learn the registry's strategies (and would scan all of `sys.modules` for each
    module the closures use: 20-30 ms of the driver's CPU per message, which held a 16-client
    round on 2 cores near one core's speed). Only the mods travel by value."""

    mods_given: tuple[Callable, ...] = ()

    def __reduce__(self):
        return (_rebuilt, (self.mods_given,))


def _rebuilt(mods: tuple[Callable, ...]) -> ClientApp:
    return build_client_app(mods) if mods else app


app = build_client_app()
