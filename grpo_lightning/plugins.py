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
    """The object a plug-in path names, its module imported now (and not before).

    Args:
        path: ``"package.module:attribute"``; ``attribute`` may be dotted (``module:Class.method``).

    Returns:
        The object.

    Raises:
        ValueError: ``path`` is not of that form.
        ImportError: the module does not import (an optional dependency missing, say).
        AttributeError: the module has no such attribute.
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"a plugin path is 'package.module:attribute', got {path!r}")
    value: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value
