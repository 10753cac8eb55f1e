"""`python -m deltaspec.cli`: the `deltaspec` command."""

import sys

from deltaspec.cli import main

sys.exit(main())
