"""``python -m benchmarks.cluster``: see :mod:`benchmarks.cluster.cli`."""

import sys

from benchmarks.cluster.cli import main

sys.exit(main())
