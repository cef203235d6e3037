"""What a mistyped run-config key most likely meant, for the error that refuses it
(`florist.config`): another tool's word for a setting, else the closest few keys."""

from __future__ import annotations

import difflib

# What other tools and papers call a setting, with its key here: difflib finds typos, not these.
SYNONYMS = {
    "learning-rate": "lr",
    "learningrate": "lr",
    "step-size": "lr",
    "epochs": "local-epochs",
    "num-epochs": "local-epochs",
    "rounds": "num-server-rounds",
    "num-rounds": "num-server-rounds",
    "server-rounds": "num-server-rounds",
    "batch": "batch-size",
    "batchsize": "batch-size",
    "bs": "batch-size",
    "seeds": "seed",
    "random-seed": "seed",
    "algorithm": "strategy",
    "method": "strategy",
    "mu": "proximal-mu",
    "fraction-fit": "fraction-train",
    "min-fit-clients": "min-train-nodes",
    "min-available-clients": "min-nodes",
    "output-dir": "results-dir",
    "out-dir": "results-dir",
}
# The number of clients is no run-config key: each command takes it as a flag.
NUM_CLIENTS_WORDS = frozenset(("clients", "num-clients", "nodes", "num-nodes", "num-supernodes", "num-partitions"))
NUM_CLIENTS_HINT = (
    "the number of clients is a flag: --num-clients (simulate, compare), --num-nodes (deploy-local, local-federation)"
)
WHERE_KEYS = "every key with its default: [tool.flwr.app.config] in pyproject.toml"


def closest_key(key: str, known: set[str]) -> str:
    """Where to look instead of `key`, in a few words: the key another tool's word means
    (`learning-rate`: `lr`), else the closest few (`local_epochs`: `local-epochs`); never all
    ~100 keys, which bury the one meant."""
    word = key.lower().replace("_", "-")
    if word in NUM_CLIENTS_WORDS:
        return NUM_CLIENTS_HINT
    meant = SYNONYMS.get(word, word)
    close = [meant] if meant in known else difflib.get_close_matches(word, sorted(known), n=3, cutoff=0.6)
    if not close:
        return f"no key is close ({WHERE_KEYS})"
    names = [repr(name) for name in close]
    return f"did you mean {' or '.join(names)}? ({WHERE_KEYS})"
