"""Soft prompt tuning (``soft_prompt_tuning``): ``n_tokens`` learned vectors before every sample's embedded tokens,
the only weights that train.

GPT-NeoX (commit ea7aefd8) reads the dict in ``megatron/training.py:907-924``: ``enabled`` (default False),
``n_tokens`` (10), ``init_string`` (""), ``init_range`` (0.5); its ``SoftEmbedding``
(``megatron/model/word_embeddings.py``) is inserted right after the embedding layer and everything whose name lacks
``soft_embedding`` is frozen. The class cannot be built at that commit (``__init__`` calls
``self.initialize_embedding(wte)`` on a method that takes no argument, a ``TypeError``, and the method reads
attributes that are never set), so there is no run to match; Deepy builds what the code sets out to do:

* the prompt ``[n_tokens, hidden]`` starts as the word embeddings of ``init_string``'s tokens (cut to n_tokens, or
  repeated up to it), else uniform in ``[-init_range, init_range]``;
* it is prepended to the output of the embedding layer (so it gets no absolute position embedding; the tokens keep
  theirs), and the blocks see ``n_tokens + s`` positions (rotary/ALiBi positions 0..n-1 for the prompt);
* where GPT-NeoX cuts the sequence back to ``seq_length`` (dropping the last n tokens) and would compare the
  outputs, shifted by n, with the unshifted labels, Deepy drops the prompt's outputs after the last block instead,
  so the logits stay those of the s tokens, aligned with their labels;
* every other weight is frozen (``requires_grad = False``), as GPT-NeoX freezes them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron.model.block import layer_parameter, uniform
from megatron.model.soft_prompt_settings import PROMPT_NAME, SoftPromptSettings
from megatron.mpu.layers import VocabParallelEmbedding

class SoftPrompt(nn.Module):
    """``weight`` ``[n_tokens, hidden]``, whole on every tensor-parallel rank (the blocks' inputs are replicated)."""

    def __init__(self, settings: SoftPromptSettings, hidden: int, seed: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_tokens = settings.n_tokens
        self.weight = layer_parameter((settings.n_tokens, hidden), name=f"{PROMPT_NAME}.weight", seed=seed,
                                      init_fn=uniform(settings.init_range), dtype=dtype)

    @torch.no_grad()
    def start_from(self, embedded: torch.Tensor) -> None:
        """Start from ``embedded`` ``[k, hidden]`` (the init string's token embeddings): its first n_tokens rows,
        or the rows repeated up to n_tokens (GPT-NeoX's ``initialize_embedding``)."""
        rows = embedded if embedded.shape[0] >= self.n_tokens else \
            embedded.repeat(math.ceil(self.n_tokens / embedded.shape[0]), 1)
        self.weight.copy_(rows[: self.n_tokens])

    def prepend(self, x_sbh: torch.Tensor, position_ids: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``[n + s, b, h]``: the prompt then the embedded tokens, the blocks' positions: None for the default
        0..n+s-1, else the prompt's 0..n-1 then the tokens' ``position_ids + n``)."""
        s, b, h = x_sbh.shape
        prompt = self.weight.to(x_sbh.dtype).unsqueeze(1).expand(self.n_tokens, b, h)  # [n, b, h]
        if position_ids is not None:
            own = torch.arange(self.n_tokens, device=position_ids.device).expand(position_ids.shape[0], -1)
            position_ids = torch.cat([own, position_ids + self.n_tokens], dim=1)  # [b|1, n + s]
        return torch.cat([prompt, x_sbh], dim=0), position_ids

    def drop(self, x_sbh: torch.Tensor) -> torch.Tensor:
        """The tokens' hidden states ``[s, b, h]`` (the prompt's outputs are not predictions of any token)."""
        return x_sbh[self.n_tokens :]


def freeze_all_but_the_prompt(model: nn.Module) -> int:
    """GPT-NeoX's freeze: every parameter whose name lacks the prompt's stops training; returns how many remain."""
    trained = 0
    for name, param in model.named_parameters():
        if PROMPT_NAME in name.split("."):
            trained += param.numel()
        else:
            param.requires_grad_(False)
    return trained


def prepare_soft_prompt(model: nn.Module, init_token_ids: list[int]) -> None:
    """After the model is built (GPTModel or this rank's pipeline stage): start the prompt from the word embeddings
    of ``init_token_ids`` (the init string's tokens, when it has any) and freeze every other weight."""
    prompts = [m for m in model.modules() if isinstance(m, SoftPrompt)]
    if init_token_ids and prompts:
        table = next(m for m in model.modules() if isinstance(m, VocabParallelEmbedding))
        with torch.no_grad():
            embedded = table(torch.tensor([init_token_ids], device=table.weight.device))[0]  # [k, h]
        for prompt in prompts:
            prompt.start_from(embedded)
    freeze_all_but_the_prompt(model)
