"""florist: personalized federated learning on Flower, from simulation to real deployments."""

__version__ = "0.1.0"
