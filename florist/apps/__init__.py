"""The composition root: the only code that knows every strategy. `registry.py` lists their
specs (no torch: the `florist` command reads it to parse a run config in milliseconds);
`client.py` is the ClientApp, which pairs each message type with the function that answers it;
`server.py` the ServerApp, which pairs each strategy with its server half. Below this folder,
`config`, `client`, `server` and `common` are handed what they need and never import a strategy."""
