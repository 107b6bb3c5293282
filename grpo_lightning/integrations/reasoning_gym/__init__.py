"""reasoning-gym: its tasks as datasets (``tasks.py``, ``levels.py``: ``dataset: reasoning_gym:<task>``) and its
own scorer as a reward (``rewards.py``: ``reasoning_gym``), loaded by name when a config asks for them."""
