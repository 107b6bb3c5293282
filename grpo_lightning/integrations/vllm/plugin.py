"""A vLLM plugin (entry point group ``vllm.general_plugins``): registers the ``gloo`` weight transport
(``integrations/vllm/gloo.py``, CPU servers) and ``checked_nccl`` (``integrations/vllm/nccl.py``, GPU servers: vLLM's
NCCL transport with every push checked) in every vLLM process of an environment where grpo_lightning is installed, and
lets vLLM load vision-language models where torchvision is missing (``integrations/vision/vllm_compat.py``)."""

from __future__ import annotations


def register() -> None:
    """Called by vLLM at start-up in each of its processes; registering twice is harmless."""
    from grpo_lightning.integrations.vision.vllm_compat import install

    install()  # vision-language models where torchvision is missing (vLLM on CPU)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to add to
        return
    for name, module, engine in (
        ("gloo", "grpo_lightning.integrations.vllm.gloo", "GlooWeightTransferEngine"),
        ("checked_nccl", "grpo_lightning.integrations.vllm.nccl", "CheckedNCCLWeightTransferEngine"),
    ):
        try:
            WeightTransferEngineFactory.register_engine(name, module, engine)
        except ValueError:  # already registered in this process
            pass
