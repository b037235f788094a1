"""Sphinx configuration of the zoomer-serve documentation (why Sphinx: docs/about-these-docs.md).

Build, strict (warnings are errors), from the repository root:
``.venv/bin/python -m sphinx -W --keep-going -b html docs /tmp/zoomer-docs``
(needs ``pip install -e '.[docs]'``)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "zoomer-serve"
author = "the zoomer-serve authors"
copyright = "the zoomer-serve authors"
from zoomer_serve import __version__ as release  # noqa: E402

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "conf.py"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = f"zoomer-serve {release}"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False
napoleon_use_ivar = True
