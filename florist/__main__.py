"""`python -m florist`: the `florist` command, without relying on the script being on PATH."""

import sys

from florist.cli import main

sys.exit(main())
