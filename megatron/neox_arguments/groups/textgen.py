"""Text generation and evaluation settings read by ``generate.py`` and ``eval.py``.

Both run the newest committed checkpoint of ``load`` (``iteration`` picks another) on the config's
parallel layout; ``train_micro_batch_size_per_gpu`` prompts or requests run together per replica.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup


class TextgenArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTextgen`` group."""

    text_gen_type: Literal["unconditional", "input-file", "interactive", "precompute"] | None = None
    """generate.py's mode: `unconditional` (num_samples samples from EOD), `input-file` (complete the prompts
    of sample_input_file), `interactive` (prompts from stdin, one per line) or `precompute` (reference
    log-probs of every configured token dataset, for DPO/KTO)."""

    precompute_model_name: str | None = None
    """Name of the reference log-probs precompute writes next to each dataset: `<prefix>_<name>.bin/.idx`."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; with top_k and top_p also 0, greedy decoding."""

    top_p: float = Field(0.0, ge=0, le=1)
    """Nucleus sampling: keep the fewest tokens whose probability reaches top_p; 0 disables it."""

    top_k: int = Field(0, ge=0)
    """Sample only from the k most likely tokens; 0 disables it."""

    return_logits: bool = False
    """Also write the logits over the vocabulary before each generated token (`logits` in the output)."""

    maximum_tokens: int = Field(64, ge=1)
    """Most tokens generated per prompt (and per eval.py generate_until request without max_gen_toks)."""

    prompt_end: str = "\n"
    """Separator between prompts in the input file."""

    sample_input_file: str | None = None
    """File of prompts for input-file generation."""

    sample_output_file: str = "samples.txt"
    """Where generated samples are written, one JSON object per line (prompt, text, tokens, ...)."""

    num_samples: int = Field(1, ge=1)
    """Number of unconditional samples to draw."""

    recompute: bool = False
    """Recompute the whole sequence for every new token instead of using the key/value cache (slow;
    for checking the cache)."""

