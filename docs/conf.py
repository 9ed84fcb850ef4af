"""Sphinx configuration of mindspeed-ha's documentation (Markdown pages, MyST).

Built in CI in strict mode: ``sphinx-build -W --keep-going -n -b html docs docs/_build/html`` fails on
any warning, a broken link or cross-reference among them."""
project = "mindspeed-ha"
author = "the mindspeed-ha developers"
copyright = "2026, the mindspeed-ha developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 4  # (pages link to each other's sections by their GitHub-style slugs)
myst_enable_extensions = ["colon_fence"]
html_theme = "alabaster"
html_title = "mindspeed-ha"
