"""``python -m resilient_comm.sim``: the same as ``resilient-comm sim``."""

import sys

from resilient_comm.sim.cli import main

sys.exit(main())
