"""The ``checked_nccl`` transport (``integrations/vllm/nccl.py``), GPU servers' side, on the CPU: vLLM's NCCL engine
receiving through the same checked load as the ``gloo`` transport (``vllm_loading.receive_checked``), its
broadcasts played by a stand-in communicator (NCCL needs GPUs) and its model a small module with vLLM's
``load_weights`` contract (the names it loaded). Marked ``vllm``; skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from grpo_lightning.integrations.vllm.nccl import CheckedNCCLWeightTransferEngine  # noqa: E402

pytestmark = pytest.mark.vllm


class Model(nn.Module):
    """Two layers whose ``load_weights`` loads the names it has, skips the rest, and reports what it loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(3, 4), nn.Linear(4, 3)

    def load_weights(self, weights):
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            if name in params:
                params[name].data.copy_(tensor)
                loaded.add(name)
        return loaded


class Broadcasts:
    """NCCL's ``broadcast`` from rank 0, played from the trainer's tensors in order."""

    def __init__(self, tensors):
        self.tensors = iter(tensors)

    def broadcast(self, weight, src, stream):
        assert src == 0
        weight.copy_(next(self.tensors))


def receiving(model, pushed, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)  # no GPU: the stand-in ignores the stream
    engine = CheckedNCCLWeightTransferEngine.__new__(CheckedNCCLWeightTransferEngine)
    engine.model, engine.device, engine.packed = model, torch.device("cpu"), False
    engine.vllm_config, engine.model_config = SimpleNamespace(lora_config=None), None
    engine.model_update_group = Broadcasts([tensor for _, tensor in pushed])
    info = SimpleNamespace(
        names=[name for name, _ in pushed],
        dtype_names=[str(tensor.dtype).removeprefix("torch.") for _, tensor in pushed],
        shapes=[list(tensor.shape) for _, tensor in pushed],
    )
    return lambda: engine.receive_weights(info)


def test_a_full_push_loads_every_weight(monkeypatch):
    model, trained = Model(), Model()
    pushed = [(name, p.detach().clone()) for name, p in trained.named_parameters()]
    receiving(model, pushed, monkeypatch)()
    for (name, tensor), (_, param) in zip(pushed, model.named_parameters()):
        torch.testing.assert_close(param, tensor, rtol=0, atol=0, msg=name)


def test_a_push_that_leaves_a_weight_unloaded_is_refused_naming_it(monkeypatch):
    """vLLM's own ``nccl`` engine discards what ``load_weights`` reports; the checked one names the first weight the
    push left unloaded (a misnamed one, skipped by the loader)."""
    model, trained = Model(), Model()
    pushed = [(name.replace("down.bias", "down.b"), p.detach().clone()) for name, p in trained.named_parameters()]
    monkeypatch.setattr(
        "vllm.model_executor.model_loader.reload.finalize_layerwise_reload", lambda model, config: None
    )  # the model was not put in a layerwise reload here: nothing to put back
    with pytest.raises(ValueError, match=r"^the weight push left down\.bias of vLLM's Model unloaded \(1 of its 4"):
        receiving(model, pushed, monkeypatch)()
