"""`python -m kivi_cli ...` runs the `kivi` command (torchrun launches it so, too)."""

import sys

from .main import main

sys.exit(main())
