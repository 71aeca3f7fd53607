"""Text generation and evaluation settings read by ``generate.py`` and ``eval.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron.neox_arguments.schema import ArgGroup


class TextgenArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTextgen`` group."""

    text_gen_type: Literal["unconditional", "input-file", "interactive", "precompute"] | None = None
    """Generation mode: `unconditional`, `input-file`, `interactive` or `precompute` (log-probs for
    DPO)."""

    precompute_model_name: str | None = None
    """Name under which precomputed reference log-probs are stored."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 means greedy decoding."""

    top_p: float = Field(0.0, ge=0, le=1)
    """Nucleus sampling: keep the fewest tokens whose probability reaches top_p; 0 disables it."""

    top_k: int = Field(0, ge=0)
    """Sample only from the k most likely tokens; 0 disables it."""

    return_logits: bool = False
    """Also return the logits of generated tokens."""

    maximum_tokens: int = Field(64, ge=1)
    """Most tokens generated per prompt."""

    prompt_end: str = "\n"
    """Separator between prompts in the input file."""

    sample_input_file: str | None = None
    """File of prompts for input-file generation."""

    sample_output_file: str = "samples.txt"
    """Where generated samples are written."""

    num_samples: int = Field(1, ge=1)
    """Number of unconditional samples to draw."""

    recompute: bool = False
    """Recompute the whole sequence for every new token instead of using the key/value cache (slow;
    for checking the cache)."""

    eval_results_prefix: str = ""
    """Prefix of the file that evaluation results are written to."""

    eval_tasks: list[str] | None = None
    """lm-evaluation-harness task names run by eval.py."""
