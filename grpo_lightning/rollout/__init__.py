"""The rollout side: the DataModule (``datamodule.py``), one round (``round.py``), sample-and-score (``sampling.py``),
prompts (``prompts.py``, ``stream.py``, ``curriculum.py``), the batch and its micro-batches (``batch.py``)."""
