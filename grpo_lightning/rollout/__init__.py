"""The rollout side: the DataModule (``datamodule.py``), the round's collector (``collector.py``), a round's maths
(``round.py``), sample-and-score (``sample_and_score.py``),
prompts (``prompts.py``, ``stream.py``, ``curriculum.py``), the batch and its micro-batches (``batch.py``)."""
