"""``python -m eagle3top``: the same as the ``eagle3-top`` command."""

import sys

from .cli import main

sys.exit(main())
