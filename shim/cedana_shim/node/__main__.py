"""``python -m cedana_shim.node install ...``: ``cedana node`` without the admin CLI."""

import sys

from .cli import main

sys.exit(main())
