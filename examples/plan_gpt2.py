"""A Hugging Face GPT-2 for ``vpipe plan --model`` (the worked example of docs/planning.md).

Needs ``transformers`` (in vpipe's ``test`` extra). Built from a config, so nothing is
downloaded: GPT-2 small's shape (12 blocks, 768 wide, 12 heads, its 50257-token vocabulary)
and one micro-batch of 2 sequences of 256 tokens::

    vpipe plan --model examples/plan_gpt2.py:gpt2 --stages 4 --memory-budget 1GB

``use_cache=False``: training keeps no key/value cache, and ``torch.distributed.pipelining.pipeline``
traces the model without one.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

MICRO_BATCH, SEQ_LEN = 2, 256


def gpt2() -> tuple[nn.Module, torch.Tensor]:
    """The model and one micro-batch of token ids, what ``vpipe plan --model`` measures."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, use_cache=False)
    return GPT2LMHeadModel(config), torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
