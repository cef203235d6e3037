import torch

from florist.server.aggregation import weighted_average


def test_weighted_average_by_hand():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(5)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(9)}
    avg = weighted_average([a, b], [1, 3])  # (1·a + 3·b) / 4
    assert torch.allclose(avg["w"], torch.tensor([2.5, 5.0]))
    assert avg["w"].dtype == torch.float32
    assert avg["n"].item() == 9  # integer buffers come from the heaviest client


def test_single_client_average_is_its_model():
    a = {"w": torch.randn(3, 3)}
    assert torch.equal(weighted_average([a], [7])["w"], a["w"])
