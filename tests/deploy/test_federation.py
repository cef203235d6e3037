import math

import pytest
from flwr.common.config import parse_config_args

from florist.config import RunConfig, parse_overrides
from florist.deploy.spawning import toml_node_config


def test_run_config_text_round_trips_and_reads_as_flower_reads_it():
    values = {
        "dp-epsilon": math.inf,
        "lr": 0.2,
        "strategy": "odpfl",
        "mask-classes": True,
        "num-server-rounds": 3,
        "partition": "dirichlet:0.5",
        "knn-ks": "1 5 10",
    }
    text = toml_node_config(values)
    assert parse_overrides(text) == values == dict(parse_config_args([text]))


def test_every_default_setting_survives_the_trip(all_settings):
    """`florist deploy-local` sends the whole run config this way."""
    defaults = all_settings
    assert (
        parse_overrides(toml_node_config(defaults)) == defaults == dict(parse_config_args([toml_node_config(defaults)]))
    )
    assert RunConfig.from_mapping(parse_overrides(toml_node_config(defaults))) == RunConfig.from_mapping({})


@pytest.mark.parametrize("text", ["lr=abc", "lr=0.1,local-epochs=2", "lr=", "=3", "lr", "a.b=1"])
def test_what_flower_would_drop_or_choke_on_is_refused_naming_the_pair(text):
    with pytest.raises(ValueError, match=f"--run-config: '{text}' is not key=value"):
        parse_overrides(text)


def test_the_staged_app_bundles_byte_for_byte_what_flwr_run_bundles_from_the_checkout():
    import hashlib

    from flwr.cli.build import build_fab_from_disk

    from florist.common.flower_internals import fab_bytes
    from florist.deploy.bundle import app_dir, checkout

    flowers = hashlib.sha256(build_fab_from_disk(checkout())).hexdigest()  # walks everything, .venv included
    assert hashlib.sha256(fab_bytes(checkout())).hexdigest() == flowers
    assert hashlib.sha256(build_fab_from_disk(app_dir())).hexdigest() == flowers
    assert app_dir() == app_dir()  # staged once per content
