"""``python -m ludic``: the same as the ``ludic`` command."""

import sys

from ludic.cli import main

sys.exit(main())
