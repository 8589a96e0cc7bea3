"""`python -m supervisor`: see supervisor.commands.cli."""

import sys

from supervisor.commands.cli import main

sys.exit(main())
