"""On-policy distillation: the teacher (``teacher.py``: a local model; ``served_teacher.py``: one served by vLLM),
built through ``grpo_lightning/distillation.py``'s contract and factory path."""
