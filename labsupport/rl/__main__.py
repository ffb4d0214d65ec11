"""``python -m labsupport.rl``: the same command line as ``python -m labsupport rl``."""

import sys

from labsupport.rl.cli import main

sys.exit(main())
