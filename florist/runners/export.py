"""`florist export`: a node's kept model (`client/personal.py`) as one TorchScript file an
application loads with plain `torch.jit.load`, without florist, and calls on samples to get the
class probabilities `florist predict` gives. kNN-Per's module carries its datastore and
(λ, k, σ, kernel) and does the interpolation itself, so nothing else travels with it.

ONNX is not offered: torch's exporters need the `onnx` (and `onnxscript`) packages, which
florist does not depend on. Nor `torch.export`, which torch 2.14's load warning points to: it
cannot save the network-only module, takes no uint8 input and is 10× slower to save and load
(docs/using-models.md has the figures)."""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from florist.client import personal
from florist.common.models import Net
from florist.common.storage import atomic_write

MODULE, MANIFEST = "model.pt", "manifest.json"
EXACT = ("flat",)  # index types whose search the export's brute-force search equals
INPUT_RANGE = (
    "as the node's samples: images scaled to [0, 1]; a uint8 input (0-255) is divided by 255 inside, "
    "as florist's training does; features as stored"
)


class Personal(nn.Module):
    """A kept model as its node predicts with it: the network's softmax, and for kNN-Per the
    mixture λ·p_kNN + (1 − λ)·p_net over the kept store (`strategies/knnper/client.py`:
    `personal_proba`, `knn_proba`, `mix`), searched exactly (brute-force L2, as FAISS's flat index).

    forward(x): x is N×input shape, float32 (uint8 images are divided by 255 first, the scaling
    florist trains with); returns N×C float32 probabilities, column c that of `class_names[c]`.
    """

    def __init__(
        self,
        net: Net,
        input_shape: tuple[int, ...],
        store: tuple[np.ndarray, np.ndarray] | None = None,
        knn: dict[str, Any] | None = None,
        class_names: list[str] | None = None,
    ):
        super().__init__()
        self.class_names = list(class_names or [])  # column c of the output is class_names[c]'s probability
        if type(net).features is not Net.features:
            raise ValueError(f"model {net.architecture!r}: its features are not its body's output; not exportable")
        self.body, self.head = net.body, net.head  # not `net`: TorchScript reads Net's class annotations as types
        self.input_shape = list(input_shape)
        embeddings, labels = store if store is not None else (np.zeros((0, 1), np.float32), np.zeros(0, np.int64))
        self.register_buffer("embeddings", torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)))
        self.register_buffer("labels", torch.from_numpy(np.asarray(labels, dtype=np.int64)))
        knn = knn or {}
        self.knn = store is not None
        self.lam, self.k = float(knn.get("lambda", 0.0)), int(knn.get("k", 1))
        self.sigma, self.paper = float(knn.get("sigma", 1.0)), knn.get("kernel", "paper") == "paper"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if list(x.shape[1:]) != self.input_shape:
            raise ValueError(f"samples of shape {list(x.shape[1:])}, but the model expects N x {self.input_shape}")
        x = x.float().div(255.0) if x.dtype == torch.uint8 else x.float()
        h = self.body(x)
        p_net = F.softmax(self.head(h), dim=1)
        if not self.knn:
            return p_net
        return (self.lam * self.knn_proba(h, p_net.shape[1]) + (1.0 - self.lam) * p_net.double()).float()

    def knn_proba(self, h: torch.Tensor, num_classes: int) -> torch.Tensor:
        """`knn_proba` (float64) on the k nearest stored embeddings: squared L2 distances
        ‖q‖² + ‖e‖² − 2q·e in float64 (in float32 they are off by 1e-5, where FAISS's flat search
        is exact to 1e-7: exp(−d/σ) at σ = 0.1 would show it), weights exp(−d/σ) (d Euclidean,
        `paper`) or exp(−d²/σ) (`squared`), shifted by each row's nearest, summed per label."""
        q, stored = h.double(), self.embeddings.double()
        d2 = (q * q).sum(1, keepdim=True) + (stored * stored).sum(1) - 2.0 * q @ stored.T
        d2, ids = torch.topk(d2, min(self.k, self.labels.shape[0]), dim=1, largest=False)
        d = d2.clamp_min(0.0).sqrt() if self.paper else d2
        weights = torch.exp(-(d - d.min(1, keepdim=True).values) / self.sigma)
        proba = torch.zeros(h.shape[0], num_classes, dtype=torch.float64, device=h.device)
        proba.scatter_add_(1, self.labels[ids], weights)
        return proba / proba.sum(1, keepdim=True)


@dataclass(frozen=True)
class Export:
    """What `export` wrote: the module and the manifest, and how long it took."""

    module: Path
    manifest: Path
    seconds: float


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch 2.14 warns that TorchScript is deprecated (for torch.export); its files still load
    with `torch.jit.load`, which is what an application is promised here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def module_for(kept: personal.Kept) -> torch.jit.ScriptModule:
    """The kept model as a scripted `Personal`: its network alone, or kNN-Per's mixture."""
    strategy = kept.manifest["strategy"]
    if strategy == "knnper":
        extras = kept.extras()
        if "embeddings" not in extras or "labels" not in extras or not len(extras["labels"]):
            raise ValueError(f"{kept.folder}: a kNN-Per model without its store (extras.npz: embeddings, labels)")
        personal_module = Personal(
            kept.network(),
            kept.input_shape,
            (extras["embeddings"], extras["labels"]),
            kept.manifest["knn"],
            kept.class_names,
        )
    else:
        from florist.apps.client import PREDICTORS

        if strategy in PREDICTORS:
            raise ValueError(
                f"{kept.folder}: strategy {strategy!r} predicts with more than its network; not exportable"
            )
        personal_module = Personal(kept.network(), kept.input_shape, class_names=kept.class_names)
    personal_module.requires_grad_(False)  # an application's calls build no autograd graph
    with _quiet():
        return torch.jit.script(personal_module.eval())


def export(kept: personal.Kept, out: Path) -> Export:
    """Write `out/model.pt` (TorchScript) and `out/manifest.json` (the kept manifest plus `export`:
    the format and what the module takes and returns) for `kept`."""
    start = time.perf_counter()
    module = module_for(kept)
    index = kept.manifest.get("knn", {}).get("index", "flat")
    search = "exact (brute-force L2, as the run's flat index)"
    if index not in EXACT:
        search = f"exact (brute-force L2); the run searched an approximate {index} index, so a few samples may differ"
    manifest = kept.manifest | {
        "class_names": kept.class_names,
        "export": {
            "format": "torchscript",
            "file": MODULE,
            "input": {"dtype": "float32", "shape": ["N", *kept.input_shape], "range": INPUT_RANGE},
            "output": "probabilities",
            "output_shape": ["N", kept.num_classes],
            "class_names": "column c is the probability of class_names[c] (also the module's `class_names`)",
            "load": f"torch.jit.load('{MODULE}')(x)",
            **({"knn_search": search} if "knn" in kept.manifest else {}),
            "exported": time.time(),
        },
    }
    try:
        out.mkdir(parents=True, exist_ok=True)
        with _quiet():
            module_path = atomic_write(out / MODULE, lambda f: torch.jit.save(module, f), shared=True)
        text = json.dumps(manifest, indent=2).encode()
        manifest_path = atomic_write(out / MANIFEST, lambda f: f.write(text), shared=True)
    except OSError as err:
        raise OSError(f"{out}: cannot write the export there ({err.strerror or err})") from None
    return Export(module_path, manifest_path, time.perf_counter() - start)
