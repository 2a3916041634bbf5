"""``python -m remat_kit.cli``: the ``remat-kit`` command."""

import sys

from remat_kit.cli import main

sys.exit(main())
