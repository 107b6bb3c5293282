"""Sandboxed code: ``sandbox.py`` runs model-written Python in a separate, limited process; ``code.py`` is the
``code_execution`` reward on it (loaded by name when a config asks for it)."""
