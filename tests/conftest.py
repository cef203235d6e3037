"""Test-wide environment: a private Flower home and cache, no telemetry, quiet Ray."""

import os
import tempfile

_home = tempfile.mkdtemp(prefix="florist-tests-")
os.environ.update(
    FLWR_HOME=os.path.join(_home, "flwr"),
    XDG_CACHE_HOME=os.path.join(_home, "cache"),
    FLWR_TELEMETRY_ENABLED="0",
    FLWR_DISABLE_UPDATE_CHECK="1",
    RAY_USAGE_STATS_ENABLED="0",
    RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
)
