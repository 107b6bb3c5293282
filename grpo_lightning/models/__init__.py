"""The model side: loading (``build.py``, ``policy.py``), the tiny Llama (``tiny.py``), the lean forward and decoder
(``lean.py``, ``lean_decoder.py``) and chunked log-probs (``logprobs.py``)."""
