"""``python -m qattn_fx``: the ``qattn-fx`` command (recipes, resolve, inspect)."""

import sys

from .cli import main

sys.exit(main())
