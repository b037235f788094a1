"""``python -m zoomer_serve`` is the ``zoomer-serve`` command."""

import sys

from zoomer_serve.cli import main

sys.exit(main())
