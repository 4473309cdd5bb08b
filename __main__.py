"""``python -m meshplan`` is the ``meshplan`` command."""

import sys

from .cli import main

sys.exit(main())
