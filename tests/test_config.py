import math
import tomllib
from pathlib import Path

import pytest

from florist.config import RunConfig, parse_overrides
from florist.deploy.spawning import toml_node_config


def test_pyproject_run_config_lists_every_declared_setting_with_its_default(all_settings):
    """Flower reads the run config's keys from pyproject.toml; a new setting fails here with
    the line to add."""
    listed = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    declared = all_settings
    wrong = {k: v for k, v in declared.items() if listed.get(k, object()) != v}
    assert not wrong, "pyproject.toml [tool.flwr.app.config] needs:\n" + "\n".join(
        toml_node_config({k: v}) for k, v in wrong.items()
    )
    assert set(listed) == set(declared), f"not declared anywhere: {sorted(set(listed) - set(declared))}"


def test_unknown_key_and_wrong_type_name_the_key():
    with pytest.raises(ValueError, match="unknown run-config key 'num-round'"):
        RunConfig.from_mapping({"num-round": 3})
    with pytest.raises(ValueError, match="'lr' expects float"):
        RunConfig.from_mapping({"lr": "fast"})
    with pytest.raises(ValueError, match="val-fraction"):
        RunConfig.from_mapping({"val-fraction": 0.6, "test-fraction": 0.5})


def test_every_section_checks_its_keys_whichever_strategy_runs():
    with pytest.raises(ValueError, match="knn-ks must list positive integers"):
        RunConfig.from_mapping({"strategy": "fedavg", "knn-ks": "5,x"})
    with pytest.raises(ValueError, match="'fedattn-k' expects int"):
        RunConfig.from_mapping({"strategy": "pefll", "fedattn-k": "three"})


def test_the_strategys_section_is_its_own_typed_settings():
    cfg = RunConfig.from_mapping({"strategy": "odpfl", "hn-local-steps": 7, "dp-epsilon": 2})
    assert (cfg.settings.local_steps, cfg.settings.dp_epsilon, cfg.settings.dp_delta) == (7, 2.0, 1e-5)
    assert RunConfig.from_mapping({"strategy": "local"}).to_mapping().keys() == RunConfig().to_mapping().keys()
    # Only what the clients use travels: the hypernetwork's server-side settings stay home.
    travelling = cfg.to_mapping(travelling=True)
    assert "hn-local-steps" in travelling and "hn-server-lr" not in travelling and "results-dir" not in travelling


def test_a_nodes_config_overrides_only_what_its_section_declares():
    knn = RunConfig.from_mapping({"strategy": "knnper"}).settings
    assert knn.for_node({"knn-index": "hnsw", "knn-sigmas": "9"}).index == "hnsw"
    assert knn.for_node({"knn-sigmas": "9"}).sigmas == knn.sigmas  # not a node setting
    dp = RunConfig.from_mapping({"strategy": "odpfl"}).settings.for_node({"dp-epsilon": 1})
    assert dp.dp_epsilon == 1.0 and math.isinf(RunConfig.from_mapping({"strategy": "odpfl"}).settings.dp_epsilon)
    with pytest.raises(ValueError, match="dp-epsilon must be > 0"):
        dp.for_node({"dp-epsilon": -1.0})


def test_overrides_parse_like_flwr_run():
    values = parse_overrides('strategy="local" lr=0.1 num-server-rounds=3')
    cfg = RunConfig.from_mapping(values)
    assert (cfg.strategy, cfg.lr, cfg.num_server_rounds) == ("local", 0.1, 3)
    assert RunConfig.from_mapping({"lr": 1}).lr == 1.0


def test_a_run_config_reads_back_from_results_json_as_it_was():
    """results.json writes an infinite setting (dp-epsilon's default) as null: JSON has no inf."""
    import json

    from florist.server.results import jsonable

    for cfg in (RunConfig(), RunConfig.from_mapping({"strategy": "odpfl", "dp-epsilon": 2.0})):
        written = json.loads(json.dumps(jsonable(cfg.to_mapping())))
        assert RunConfig.from_mapping(written) == cfg
