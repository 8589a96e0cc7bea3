"""`python -m supervisor`: see supervisor.cli."""

import sys

from supervisor.cli import main

sys.exit(main())
