"""Host-side runs of the ServerApp: Flower simulation, in-process, real processes, compare, and
the checks before a run. Importing any of them hands the run config its strategies (every entry
point imports the registry first: `florist/config.py`)."""

import florist.apps.registry  # noqa: F401
