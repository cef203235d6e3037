"""`python -m florist`: the `florist` command, without relying on the script being on PATH."""

from florist.cli import run

run()
