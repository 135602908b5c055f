"""`python -m furcate ...` is the `furcate` command."""

import sys

from .cli import main

sys.exit(main())
