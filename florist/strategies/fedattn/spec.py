"""FedAttn (Luo, Panchal, Guan, "Personalized Federated Learning through Collaboration with
Nearest Neighbors"): the model's bias vectors M are personal, the rest G is averaged. For
client i the server attends over the K clients nearest to it by representation Z (found with
FAISS): M̃_i = Σ_j a_ij·W_V·M_j with a_i = softmax(W_Q Z_i · W_K Z_j / √d_k), and trains W_Q,
W_K, W_V through the gradients ∂L/∂M̃_i the clients send back."""

from __future__ import annotations

import dataclasses

from florist.common.settings import Settings, setting
from florist.common.spec import Exchange, StrategySpec
from florist.strategies.fedavg.spec import EVALUATE, SECAGG

Z, BIAS_GRAD = "z", "bias-grad"  # keys of the `side` ArrayRecord: Z_i, and ∂L/∂M̃_i at the biases received
M = "m"  # and, under secure aggregation (the trained model goes masked), the node's new biases M_i


@dataclasses.dataclass(frozen=True)
class AttentionSettings(Settings):
    prefix = "fedattn"
    k: int = setting(5, server=True)  # K nearest clients the attention reads
    key_dim: int = setting(16, server=True)  # d_k of W_Q and W_K
    lr: float = setting(1e-3, server=True)  # Adam step of W_Q, W_K, W_V
    warmup: int = setting(5, server=True)  # FedAvg-only rounds before attention starts (0: none)
    clip: float = setting(1.0, server=True)  # gradient-norm clip of the attention (0: none)
    reg: float = setting(0.1, server=True)  # penalty on ‖M̃_i − mean M‖² (0: none)
    residual: bool = setting(True, server=True)  # attend over deviations: M̃ = M̄ + Σ a·W_V(M − M̄)
    include_self: bool = setting(True, server=True)  # a trained client's own (Z, M) is one of its K keys

    def checks(self):
        return [
            (self.k >= 1 and self.key_dim >= 1, "fedattn-k and fedattn-key-dim must be >= 1"),
            (self.lr > 0, "fedattn-lr must be > 0"),
            (
                min(self.warmup, self.clip, self.reg) >= 0,
                "fedattn-warmup, fedattn-clip and fedattn-reg must be >= 0 (0: off)",
            ),
        ]

    def warnings(self, num_rounds: int) -> list[str]:
        if 0 < num_rounds <= self.warmup:
            return [
                f"fedattn-warmup {self.warmup} >= num-server-rounds {num_rounds}: the attention never runs and "
                "this run is FedAvg (raise the rounds or lower fedattn-warmup)"
            ]
        return []


TRAIN_ATTN = Exchange("train.attn")  # G + M̃_i down; G, M_i, and Z_i, ∂L/∂M̃_i beside, up
REPRESENT = Exchange("query.represent")  # a model down, Z up

FEDATTN = StrategySpec(
    "fedattn",
    "FedAttn: attention over the nearest clients' bias vectors",
    (TRAIN_ATTN, REPRESENT, EVALUATE, *SECAGG),
    AttentionSettings,
    record_covered=True,  # its biases and shared part from DP-SGD steps, Z and the bias gradient as noised steps
)
