"""A tiny Llama and a character tokenizer, built in code: the offline default for demos and tests.

Nothing here is downloaded. The model is a standard ``transformers`` ``LlamaForCausalLM`` built from a config and
the tokenizer a ``PreTrainedTokenizerFast`` over single characters, so both save with ``save_pretrained`` and load
back through the same ``AutoModelForCausalLM`` / ``AutoTokenizer`` path that Hub models take.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Printable ASCII plus newline: enough for arithmetic, countdown and small text tasks.
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2."""
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for char in CHARACTERS:
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token, and decoding concatenates them back without spaces.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    tokenizer.model_max_length = 512
    return tokenizer


@dataclass
class TinyModelConfig:
    """Size of the built-in tiny Llama (used when ``model_name_or_path`` is not set)."""

    hidden_size: int = 128
    """Width of the residual stream (the embedding size); ``num_heads`` divides it into heads of an even size."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads per layer (as many key/value heads: no grouped-query attention)."""
    intermediate_size: int = 256
    """Width of each layer's MLP."""
    max_position_embeddings: int = 128
    """The context length in tokens: the longest prompt + completion the model takes."""

    def __post_init__(self) -> None:
        from grpo_lightning.config import ConfigError

        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.tiny_model.{name} must be >= 1 (got {getattr(self, name)})")
        # Rotary embeddings rotate pairs of each head's dimensions: a head needs an even number of them.
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(
                f"model.tiny_model.hidden_size ({self.hidden_size}) must be a multiple of model.tiny_model.num_heads "
                f"({self.num_heads}) with an even quotient (each head's size)"
            )


def build_tiny_llama(config: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` sized by ``config`` for ``tokenizer``'s vocabulary."""
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(llama_config)
