"""PeFLL with the paper's own pieces: the authors' embedding network (`hn-encoder="paper"`) and
the clients' SGD momentum (`momentum`, 0.9 in the paper; florist's default 0)."""

import pytest
import torch

from florist.apps.server import server_half
from florist.config import RunConfig
from florist.runners.inprocess import run_in_process
from florist.strategies.pefll.networks import EmbeddingNet

# The authors' CNNEmbed on CIFAR-10 with the label as 10 image channels (PeFLL's models.py,
# train.py with --embed-y true), l = 26: parameter shapes in the order of their state dict.
AUTHORS_CNN_EMBED = [
    (16, 13, 5, 5),  # conv1
    (16,),
    (32, 16, 5, 5),  # conv2
    (32,),
    (120, 32 * 5 * 5),  # fc1
    (120,),
    (84, 120),  # fc2
    (84,),
    (26, 84),  # fc3
    (26,),
]


def test_the_paper_encoder_has_the_authors_layers_and_gives_one_descriptor_per_client():
    net = EmbeddingNet((3, 32, 32), 10, 26, kind="paper")
    assert [tuple(p.shape) for p in net.parameters()] == AUTHORS_CNN_EMBED
    x, y = torch.rand(7, 3, 32, 32), torch.randint(0, 10, (7,))
    assert net(x, y).shape == (7, 26) and net.describe(x, y).shape == (26,)


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28)])
def test_the_paper_encoder_takes_the_small_images_too(shape):
    """28×28 as the authors' (FEMNIST); 8×8 digits pad the 5×5 convolutions (2×2 maps left)."""
    net = EmbeddingNet(shape, 10, 3, kind="paper")
    side = 2 if shape[1] == 8 else 4
    assert net.body[1].in_features == 32 * side * side
    v = net.describe(torch.rand(5, *shape), torch.arange(5))
    assert v.shape == (3,) and torch.isfinite(v).all()


def test_hn_encoder_paper_is_what_the_server_builds_and_the_nodes_use(tmp_path):
    cfg = RunConfig.from_mapping({"strategy": "pefll", "hn-encoder": "paper", "hn-embed-dim": 3})
    server = server_half("pefll")(cfg, None, (1, 8, 8), 1)
    expected = EmbeddingNet((1, 8, 8), 10, 3, kind="paper").state_dict()
    assert {k: v.shape for k, v in server.embed.state_dict().items()} == {k: v.shape for k, v in expected.items()}
    default = RunConfig.from_mapping({"strategy": "pefll", "hn-embed-dim": 3})
    assert server_half("pefll")(default, None, (1, 8, 8), 1).embed.kind == "label-channels"  # unchanged
    # the nodes build the same network: they load the server's weights and send a descriptor back
    results, _ = _one_round(tmp_path, "paper", **{"hn-encoder": "paper"})
    assert results["complete"] and not results["failures"]


class _RecordingSGD(torch.optim.SGD):
    """torch's SGD, recording the momentum of every one built and whether it kept a buffer."""

    built: list["_RecordingSGD"] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built.append(self)

    def buffers_used(self) -> bool:
        return all(self.state[p].get("momentum_buffer") is not None for g in self.param_groups for p in g["params"])


def _one_round(tmp_path, name, **overrides):
    values = {
        "strategy": "pefll",
        "num-server-rounds": 1,
        "partition": "iid",
        "unseen-fraction": 0.0,
        "min-nodes": 2,
        "min-train-nodes": 2,
        "eval-every": 0,
        "hn-local-steps": 3,
        "hn-embed-dim": 3,
        "results-dir": str(tmp_path / name),
    } | overrides
    results = run_in_process(RunConfig.from_mapping(values), 2)
    return results, torch.load(tmp_path / name / "checkpoint.pt")["state"]


def test_client_momentum_reaches_every_local_step_of_pefll(tmp_path, monkeypatch):
    """`momentum` is PeFLL's client momentum: each client's optimizer in `train.generated`
    takes it, keeps its buffers, and the round's update differs from the momentum-free one."""
    monkeypatch.setattr(torch.optim, "SGD", _RecordingSGD)
    runs = {}
    for momentum in (0.0, 0.9):
        _RecordingSGD.built = []
        _, runs[momentum] = _one_round(tmp_path, f"m{momentum}", lr=0.05, momentum=momentum)
        assert [g["momentum"] for sgd in _RecordingSGD.built for g in sgd.param_groups] == [momentum] * 2
        assert all(sgd.buffers_used() == (momentum > 0) for sgd in _RecordingSGD.built)
    moved = [not torch.allclose(runs[0.0]["hyper"][k], runs[0.9]["hyper"][k]) for k in runs[0.0]["hyper"]]
    assert any(moved)
