"""vLLM: ``engine.py`` (``data.engine: vllm``, in the training process), ``server.py`` (``vllm_server``: running
servers, weights pushed by ``weight_transfer.py`` over ``gloo.py`` or ``nccl.py``, each push checked by
``loading.py``), ``plugin.py`` (vLLM's plugin entry point that registers the transports)."""
