"""``python -m benchmarks NAME [--repeats N] [--scale S] [--quick] [--set KEY=VALUE]``, ``--list``, ``--all``."""

import os
import sys

# The benchmark modules import each other by plain name (their workers run as scripts from this directory).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

sys.exit(harness.main())
