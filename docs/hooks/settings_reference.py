"""mkdocs hook: the settings reference page (``reference/settings.md``) is generated when the site is built.

The page in the tree is a stub; this hook replaces its markdown with ``tools/settings_reference.py``'s output (every
key of the config classes, read from the code), so the site's reference cannot drift. A key without a description
is logged as a warning, which ``mkdocs build --strict`` turns into a failed build.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

PAGE = "reference/settings.md"
GENERATOR = Path(__file__).resolve().parents[2] / "tools" / "settings_reference.py"

log = logging.getLogger("mkdocs.hooks.settings_reference")


def _generator() -> ModuleType:
    """``tools/settings_reference.py`` as a module (in ``sys.modules`` before it runs: its dataclasses need it)."""
    name = "settings_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GENERATOR)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """The generated reference in place of the stub; every other page as it is."""
    if page.file.src_uri != PAGE:
        return markdown
    generator = _generator()
    groups = [group for groups in generator.sections().values() for group in groups]
    for key in generator.missing_descriptions(groups):
        log.warning("settings reference: %s has no description (its field docstring or Args: entry)", key)
    return generator.reference()
