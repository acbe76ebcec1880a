"""``python -m onebit.estimate``: see :mod:`onebit.estimate.cli`."""

import sys

from .cli import main

sys.exit(main())
