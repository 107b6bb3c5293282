"""Where the core reaches an integration: by a ``"module:attribute"`` path, resolved here and nowhere else.

The core never imports an integration (vLLM, images, environments, agents, the teacher, reasoning-gym, the sandbox,
SFT; ``tests/test_architecture.py`` enforces it). Where a config names one (``data.engine: vllm``), the core's
registry holds its path as a string and this function loads it when, and only when, it is asked for: a run that does
not name vLLM never imports it, and the import graph stays one-way.
"""

from __future__ import annotations

import importlib
from typing import Any


def load_plugin(path: str) -> Any:
    """The object ``path`` names: ``"package.module:attribute"`` (``attribute`` may be dotted)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"a plugin path is 'package.module:attribute', got {path!r}")
    value: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value
