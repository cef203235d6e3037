"""OD-PFL, as ODPFL-HN ("On-Demand Unlabeled Personalized Federated Learning"): PeFLL's
training shape (descriptor, hypernetwork, chain rule back; `strategies/pefll.py`) with a set
encoder on unlabeled samples (`common/hypernet.py`). A node that joins after training needs
no labels: it sends its descriptor, optionally noised for (ε, δ)-differential privacy, and
receives its model, two messages down and one up."""

from __future__ import annotations

from florist.strategies.pefll import PeFLL


class ODPFL(PeFLL):
    """The encoder is `ENCODERS["odpfl"]`, chosen by this name on both sides."""

    name = "odpfl"
