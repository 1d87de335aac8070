"""Model factories for the `vpipe plan --model` tests (`tests/support/plan_models.py:NAME`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class EncoderDecoder(nn.Module):
    """Decoder blocks that take two arguments and a keyword one: ``layer(h, memory, tgt_mask=mask)``,
    the memory being the encoder's output (it crosses every decoder boundary)."""

    def __init__(self, dim: int = 32, encoders: int = 2, decoders: int = 4, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0,
                                                                batch_first=True)
                                     for _ in range(encoders))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(dim, 4, 4 * dim, dropout=0.0,
                                                                batch_first=True)
                                     for _ in range(decoders))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        memory = self.embed(tokens)
        for layer in self.encoder:
            memory = layer(memory)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        h = memory
        for layer in self.decoder:
            h = layer(h, memory, tgt_mask=mask)
        return self.head(self.norm(h))


def encoder_decoder() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return EncoderDecoder(), torch.randint(0, 64, (2, 12))


def hf_gpt2() -> tuple[nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0,
                        eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(config), torch.zeros(2, 32, dtype=torch.long)


def tutorial_transformer() -> tuple[nn.Module, torch.Tensor]:
    """The pipelining tutorial's (and torchtitan's) model from
    ``examples/train_tutorial.py``: ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict``
    keyed by global id), ``norm``, ``output``; one micro-batch of token ids."""
    spec = importlib.util.spec_from_file_location("train_tutorial", EXAMPLES / "train_tutorial.py")
    assert spec is not None and spec.loader is not None
    example = sys.modules.setdefault("train_tutorial", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(example)  # registered first: its dataclass looks its module up
    torch.manual_seed(0)
    return example.Transformer(example.ModelArgs(dim=32, n_layers=6)), torch.zeros(2, 16, dtype=torch.long)


def raises() -> nn.Module:
    raise RuntimeError("the factory failed\nwith a second line")


def not_a_module() -> int:
    return 3


def exits() -> nn.Module:
    """A factory that ends the process instead of returning a model."""
    raise SystemExit(0)
