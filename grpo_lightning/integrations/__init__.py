"""Integrations: what plugs into the core through its declared extension points, and nothing the core imports.

Each folder is one integration: ``vllm/`` (engines on vLLM, in process and on servers), ``vision/`` (images: the
``ImageModality``), ``environments/`` (multi-turn rollouts: tools, OpenEnv, skyrl-gym, TRL's classes), ``agents/``
(agents that run their own loop), ``distillation/`` (the teacher), ``reasoning_gym/`` (its tasks and reward),
``sandbox/`` (the code reward's sandbox), and ``sft.py`` (supervised fine-tuning). The core reaches one only by its
``"module:attr"`` path (``grpo_lightning/plugins.py``) or by a class a config names; ``tests/test_architecture.py``
checks that no module outside this folder imports one.
"""
