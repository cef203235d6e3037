import math

from florist.common.config import RunConfig, all_settings, parse_overrides
from florist.deploy.federation import toml_node_config


def test_run_config_text_round_trips_through_flowers_parser():
    values = {"dp-epsilon": math.inf, "lr": 0.2, "strategy": "odpfl", "mask-classes": True, "num-server-rounds": 3}
    assert parse_overrides(toml_node_config(values)) == values


def test_every_default_setting_survives_the_trip():
    """`florist deploy-local` sends the whole run config this way."""
    defaults = all_settings()
    assert parse_overrides(toml_node_config(defaults)) == defaults
    assert RunConfig.from_mapping(parse_overrides(toml_node_config(defaults))) == RunConfig.from_mapping({})
