"""florist: personalized federated learning on Flower, from simulation to real deployments."""

__version__ = "0.1.0"

# The exceptions florist raises with a one-line explanation of what to change: the `florist`
# command and the ServerApp's log print these as that line (FLORIST_DEBUG=1: with the traceback);
# any other is a bug, and keeps its traceback.
USER_ERRORS = (ValueError, OSError, TimeoutError, RuntimeError)
