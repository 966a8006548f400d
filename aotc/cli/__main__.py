"""`python -m aotc.cli`: the `aotc` command."""

import sys

from . import main

sys.exit(main())
