"""``python -m resilient_comm.elastic`` is ``resilient-run``."""

import sys

from resilient_comm.elastic.launcher import main

sys.exit(main())
