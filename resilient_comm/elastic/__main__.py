"""``python -m resilient_comm.elastic`` is ``resilient-run`` (`node.launcher`)."""

import sys

from resilient_comm.elastic.node.cli import main

sys.exit(main())
