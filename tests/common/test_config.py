import tomllib
from pathlib import Path

import pytest

from florist.common.config import RunConfig, parse_overrides


def test_pyproject_run_config_lists_every_key_with_its_default():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["tool"]["flwr"]["app"]["config"] == RunConfig().to_mapping()


def test_unknown_key_and_wrong_type_name_the_key():
    with pytest.raises(ValueError, match="unknown run-config key 'num-round'"):
        RunConfig.from_mapping({"num-round": 3})
    with pytest.raises(ValueError, match="'lr' expects float"):
        RunConfig.from_mapping({"lr": "fast"})
    with pytest.raises(ValueError, match="val-fraction"):
        RunConfig.from_mapping({"val-fraction": 0.6, "test-fraction": 0.5})


def test_overrides_parse_like_flwr_run():
    values = parse_overrides('strategy="local" lr=0.1 num-server-rounds=3')
    cfg = RunConfig.from_mapping(values)
    assert (cfg.strategy, cfg.lr, cfg.num_server_rounds) == ("local", 0.1, 3)
    assert RunConfig.from_mapping({"lr": 1}).lr == 1.0
