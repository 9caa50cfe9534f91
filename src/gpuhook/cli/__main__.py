"""`python -m gpuhook.cli …` is `gpuhook …`."""

import sys

from gpuhook.cli import main

sys.exit(main())
