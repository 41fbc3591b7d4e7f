"""``python -m tailguard.server``: the same as the ``tailguard`` command."""

import sys

from .cli import main

sys.exit(main())
