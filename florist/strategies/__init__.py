"""The algorithms florist runs, each one folder: `spec.py` (what both halves share: settings,
message types, record keys; no torch), `server.py` and `client.py` (the halves, which import the
spec and never each other), and at most one module of its own machinery. A half may use another
strategy's only through a named shared piece: kNN-Per's clients train with FedAvg's `train`, and
FedAttn's server extends FedAvg's. The registry that lists them, and pairs each message type and
strategy with its half, is `florist/apps/`."""
