"""``python -m kv8``: the ``kv8`` command line."""

import sys

from kv8.entrypoints.cli import main

sys.exit(main())
