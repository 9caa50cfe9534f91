"""`python -m gpuhook.cli …` is `gpuhook …`."""

import sys

from gpuhook.cli.app import main

sys.exit(main())
