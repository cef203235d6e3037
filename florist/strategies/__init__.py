"""Server halves of the algorithms, by the name `--strategy` and the run config take."""

from florist.strategies.base import Federation, NodeInfo, Strategy
from florist.strategies.fedattn import FedAttn
from florist.strategies.fedavg import FedAvg, FedAvgFinetune
from florist.strategies.knnper import KnnPer
from florist.strategies.local import Local
from florist.strategies.odpfl import ODPFL
from florist.strategies.pefll import PeFLL
from florist.strategies.perfedckt import PerFedCKT

STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (FedAvg, FedAvgFinetune, Local, KnnPer, PeFLL, ODPFL, PerFedCKT, FedAttn)
}

__all__ = ["STRATEGIES", "Federation", "NodeInfo", "Strategy"]
