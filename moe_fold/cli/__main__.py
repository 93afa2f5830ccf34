"""``python -m moe_fold.cli`` (what torchrun launches): the ``moe-fold`` command."""

import sys

from moe_fold.cli import main

sys.exit(main())
