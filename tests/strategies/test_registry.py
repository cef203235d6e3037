"""The registry and the contract between the halves: one place per algorithm, one handler per
message type, halves that share only their spec, messages whose keys are checked both ways."""

import ast
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message, RecordDict

import florist.client.messages as client_app_module
import florist.strategies
from florist.apps.client import HANDLERS, app, exchanges
from florist.apps.registry import STRATEGIES
from florist.apps.server import server_half
from florist.client.node import parse
from florist.common import protocol
from florist.common.models import seeded_model
from florist.common.protocol import message_config
from florist.common.spec import INFO
from florist.config import RunConfig
from florist.runners.inprocess import server_identity
from florist.server.strategy import ServerStrategy
from florist.strategies.knnper.spec import EVALUATE_KNNPER

ALGORITHMS = Path(florist.strategies.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }


@pytest.mark.parametrize("half", ["client", "server"])
def test_a_half_never_imports_the_other_half(half):
    other = {"client": "server", "server": "client"}[half]
    for path in ALGORITHMS.glob(f"*/{half}.py"):
        wrong = {m for m in _imports(path) if m.startswith("florist.") and m.endswith(f".{other}")}
        assert not wrong, f"{path.relative_to(ALGORITHMS)} imports {wrong}"


class Dispatched(Exception):
    """Raised where a handler of florist's ClientApp starts on a message, naming its exchange."""

    def __init__(self, exchange):
        self.exchange = exchange


def test_every_exchange_has_one_handler_and_every_spec_loads(monkeypatch):
    reached = []

    def dispatched(msg, context, exchange, strategies):
        reached.append(exchange)
        raise Dispatched(exchange)

    monkeypatch.setattr(client_app_module, "parse", dispatched)  # each handler's first step
    for message_type, exchange in exchanges().items():  # each reaches its own handler, not Flower's "no handler"
        reply = app(_message({}, message_type), _context())  # the frame makes what it raised an error reply
        assert reply.error.reason.startswith(f"Dispatched in {message_type}: ") and reached[-1] == exchange
        handler = HANDLERS[message_type]  # a strategy's client half, or the ClientApp's own for INFO
        assert callable(handler) and handler.__module__.endswith(".client" if exchange != INFO else ".messages")
    with pytest.raises(ValueError, match="No query function registered with name 'undeclared'"):
        app(_message({}, "query.undeclared"), _context())  # what a type without a handler gets
    assert len(exchanges()) == 1 + len({e.message_type for s in STRATEGIES.values() for e in s.exchanges})
    for spec in STRATEGIES.values():
        server = server_half(spec.name)
        assert issubclass(server, ServerStrategy) and server.__module__.startswith("florist.strategies.")
        assert server.__module__.endswith(".server")


def _message(config: dict, message_type: str) -> Message:
    with server_identity(1):
        return Message(protocol.content(config=config), dst_node_id=5, message_type=message_type)


def _context() -> Context:
    return Context(
        run_id=1, node_id=5, node_config={"partition-id": 0, "num-partitions": 4}, state=RecordDict(), run_config={}
    )


def test_a_florist_message_must_carry_exactly_the_declared_keys():
    cfg = RunConfig.from_mapping({"strategy": "knnper", "knn-ks": "3"})
    config = message_config(cfg, EVALUATE_KNNPER, 2, 1)
    node, request = parse(_message(config, "evaluate.knnper"), _context(), EVALUATE_KNNPER, STRATEGIES)
    assert (node.server_round, node.cfg.settings.k_grid, node.key) == (2, (3,), "partition-0")
    with pytest.raises(protocol.ProtocolError, match=r"unknown keys \['knn-kz'\], missing keys \['knn-ks'\]"):
        typo = {("knn-kz" if k == "knn-ks" else k): v for k, v in config.items()}
        parse(_message(typo, "evaluate.knnper"), _context(), EVALUATE_KNNPER, STRATEGIES)
    with pytest.raises(protocol.ProtocolError, match=r"missing keys \['server-round'\]"):
        parse(
            _message({k: v for k, v in config.items() if k != "server-round"}, "evaluate.knnper"),
            _context(),
            EVALUATE_KNNPER,
            STRATEGIES,
        )


def test_a_standard_message_from_a_flower_strategy_uses_the_run_config():
    context = _context()
    context.run_config.update({"lr": 0.05, "strategy": "fedavg"})
    node, _ = parse(_message({"server-round": 3, "lr": 0.01}, "train"), context, INFO, STRATEGIES)
    assert (node.server_round, node.cfg.lr) == (3, 0.01)


def test_building_a_seeded_model_leaves_torchs_global_generator_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = seeded_model("cnn", (1, 8, 8), 10, seed=1)
    assert torch.equal(torch.rand(3), expected)
    second = seeded_model("cnn", (1, 8, 8), 10, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
