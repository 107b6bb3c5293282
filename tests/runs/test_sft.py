"""SFT: the loss counts response tokens only, packing changes nothing but speed, and the HF hand-off to GRPO."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import TINY

from grpo_lightning.cli import SFTCLI
from grpo_lightning.engines import LeanEngine, SamplingParams
from grpo_lightning.integrations.sft import (
    IGNORE_INDEX,
    SFTDataModule,
    SFTModule,
    encode_examples,
    pack_examples,
    pad_batch,
    response_loss,
)
from grpo_lightning.module import GRPOModule
from grpo_lightning.rollout.prompts import PromptEncoder


def test_response_loss_counts_response_tokens_only():
    # Input "a b = c d": positions 0-2 are the prompt, 3-4 the response.
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 7, requires_grad=True)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 4, 6]])
    loss, count = response_loss(logits, labels)
    # By hand: logits at position t predict the token at t + 1, so positions 2 and 3 predict the two response tokens.
    expected = F.cross_entropy(logits[0, 2:3], torch.tensor([4])) + F.cross_entropy(logits[0, 3:4], torch.tensor([6]))
    assert count.item() == 2
    assert torch.allclose(loss, expected / 2)
    loss.backward()
    # Positions that predict prompt tokens (0, 1) and the last one (nothing to predict) get no gradient.
    assert logits.grad[0, [0, 1, 4]].abs().sum() == 0
    assert logits.grad[0, [2, 3]].abs().sum() > 0


def test_examples_label_the_response_and_eos_only():
    module = SFTModule(tiny_model=TINY)
    [(ids, labels)] = encode_examples(PromptEncoder(module.tokenizer), ["12+3="], ["15"])
    tokenizer = module.tokenizer
    prompt = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    response = [*tokenizer("15", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    assert ids == prompt + response
    assert labels == [IGNORE_INDEX] * len(prompt) + response


def test_packed_rows_give_the_loss_of_padded_examples(tiny_llama):
    module = SFTModule(tiny_model=TINY)
    examples = encode_examples(
        PromptEncoder(module.tokenizer), ["1+2=", "34+56=", "7+8=", "90+9="], ["3", "90", "15", "99"]
    )
    padded = pad_batch(examples, module.tokenizer.pad_token_id)
    rows = pack_examples(examples, 24, module.tokenizer.pad_token_id)
    assert len(rows) == 2  # 10 + 10 tokens do not fit in 24 with the third example
    packed = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    with torch.no_grad():
        unpacked_loss, n = response_loss(tiny_llama(**padded, use_cache=False).logits, padded["labels"])
        # No attention mask: the model builds a block-diagonal causal mask from the restarting position ids.
        logits = tiny_llama(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        packed_loss, m = response_loss(logits, packed["labels"])
    assert n == m
    assert torch.allclose(unpacked_loss, packed_loss, atol=1e-5)


def test_packing_needs_a_row_length():
    from grpo_lightning.config import ConfigError

    with pytest.raises(ConfigError, match="max_length"):
        SFTDataModule(dataset="x.jsonl", packing=True)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_fit_writes_a_folder_grpo_starts_from(tmp_path, packing):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(40)))
    out = tmp_path / "hf"
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 6,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [{"class_path": "grpo_lightning.callbacks.SaveHFModel", "init_args": {"dirpath": str(out)}}],
        },
        "model": {
            "tiny_model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "lr": 1e-2,
            "lr_schedule": "cosine",
            "warmup_steps": 2,
        },
        "data": {
            "dataset": str(data),
            "sampling": {"max_new_tokens": 4},
            "val_dataset": "arithmetic",
            "eval": {"limit": 8},
            "task_kwargs": {"test_size": 50},
            "batch_size": 4,
            "packing": packing,
            "max_length": 32,
        },
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = SFTCLI(args=["fit", "--config", str(path)])
    losses = cli.trainer.callback_metrics
    assert torch.isfinite(losses["train/loss"])
    assert cli.trainer.global_step == 6
    lr_schedule = cli.trainer.lr_scheduler_configs[0].scheduler
    assert lr_schedule.get_last_lr()[0] < 1e-2  # cosine decay ran

    # The hand-off: GRPO's model_name_or_path takes the folder, and it holds the weights SFT trained.
    grpo = GRPOModule(model_name_or_path=str(out))
    grpo.configure_model()
    trained = cli.model.policy.state_dict()
    for name, value in grpo.policy.state_dict().items():
        assert torch.equal(value, trained[name]), name
    engine = LeanEngine()
    engine.setup(grpo.policy, grpo.tokenizer)
    ids, mask = PromptEncoder(grpo.tokenizer).encode(["3+1="])
    completions = engine.generate(ids, mask, SamplingParams(max_new_tokens=4, greedy=True))
    assert completions.completion_ids.shape[0] == 1
    # Evaluation works on the same held-out data GRPO uses.
    results = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert 0.0 <= results[0]["val/accuracy"] <= 1.0
