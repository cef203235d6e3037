"""kNN-Per (Marfoq et al., ICML 2022): the global model is FedAvg's, unchanged; each client
personalizes it at evaluation with its own FAISS datastore (`client/knnper.py`)."""

from __future__ import annotations

from florist.common import protocol
from florist.strategies.fedavg import FedAvg


class KnnPer(FedAvg):
    """FedAvg training; evaluation and the serve phase through `evaluate.knnper`."""

    name = "knnper"
    evaluate_type = protocol.EVALUATE_KNNPER
