"""``python -m zoomer_serve.reference [--check]``: see :mod:`zoomer_serve.reference`."""

import sys

from zoomer_serve.reference import main

sys.exit(main())
