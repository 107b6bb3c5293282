"""Vision-language GRPO (issue 42): prompts with images, per-row image inputs, and the models that read them.

``tiny``: tiny Qwen2-VL, LLaVA and Idefics3 models built in code; ``processors``: loading a model's processor;
``images``: image columns (``image`` / ``images``) read and checked; ``encoder``: prompts with images to token ids
and per-row image inputs; ``inputs``: those inputs joined per forward; ``models``: loading and freezing. What works
and what does not yet: docs/vision.md.
"""
