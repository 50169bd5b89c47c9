"""`python -m kubetrain` is the `kubetrain` command."""

import sys

from kubetrain.cli import main

sys.exit(main())
