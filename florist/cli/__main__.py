"""`python -m florist.cli`, as `python -m florist`."""

from florist.cli import run

run()
