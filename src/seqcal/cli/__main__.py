"""``python -m seqcal.cli``: the ``seqcal`` command."""

import sys

from seqcal.cli import main

sys.exit(main())
