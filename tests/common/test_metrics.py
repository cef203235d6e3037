import math

import pytest

from florist.common.metrics import bottom_decile, summarize, weighted_mean


def test_weighted_mean_by_hand():
    # (0.5·10 + 1.0·30) / 40 = 0.875
    assert weighted_mean([0.5, 1.0], [10, 30]) == pytest.approx(0.875)
    assert math.isnan(weighted_mean([], []))


def test_bottom_decile_is_an_actual_client():
    # 11 clients: rank floor(0.1·10) = 1 → the second-lowest value
    values = [0.9, 0.1, 0.8, 0.7, 0.6, 0.2, 0.5, 0.4, 0.3, 1.0, 0.95]
    assert bottom_decile(values) == 0.2
    # 20 clients: rank floor(0.1·19) = 1
    assert bottom_decile([i / 20 for i in range(20)]) == 1 / 20
    # fewer than 11 clients: the worst one
    assert bottom_decile([0.7, 0.3, 0.9]) == 0.3


def test_summary_keys_and_values():
    s = summarize([1.0, 0.0, 0.5], [2, 2, 4])
    assert s == {"mean_accuracy": 0.5, "bottom_decile_accuracy": 0.0, "num_clients": 3}
