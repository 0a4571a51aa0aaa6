"""``python -m schedules``: see schedules.cli."""

import sys

from schedules.cli import main

sys.exit(main())
