"""Text generation and evaluation settings read by ``generate.py`` and ``eval.py``.

Those entry points are not built yet, so every key here is accepted only at its default.
"""

from __future__ import annotations

from typing import Literal


from megatron.neox_arguments.schema import ArgGroup, not_supported


class TextgenArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTextgen`` group."""

    text_gen_type: Literal["unconditional", "input-file", "interactive", "precompute"] | None = not_supported(None)
    """Generation mode: `unconditional`, `input-file`, `interactive` or `precompute` (log-probs for
    DPO)."""

    precompute_model_name: str | None = not_supported(None)
    """Name under which precomputed reference log-probs are stored."""

    temperature: float = not_supported(0.0)
    """Sampling temperature; 0 means greedy decoding."""

    top_p: float = not_supported(0.0)
    """Nucleus sampling: keep the fewest tokens whose probability reaches top_p; 0 disables it."""

    top_k: int = not_supported(0)
    """Sample only from the k most likely tokens; 0 disables it."""

    return_logits: bool = not_supported(False)
    """Also return the logits of generated tokens."""

    maximum_tokens: int = not_supported(64)
    """Most tokens generated per prompt."""

    prompt_end: str = not_supported("\n")
    """Separator between prompts in the input file."""

    sample_input_file: str | None = not_supported(None)
    """File of prompts for input-file generation."""

    sample_output_file: str = not_supported("samples.txt")
    """Where generated samples are written."""

    num_samples: int = not_supported(1)
    """Number of unconditional samples to draw."""

    recompute: bool = not_supported(False)
    """Recompute the whole sequence for every new token instead of using the key/value cache (slow;
    for checking the cache)."""

    eval_results_prefix: str = not_supported("")
    """Prefix of the file that evaluation results are written to."""

    eval_tasks: list[str] | None = not_supported(None)
    """lm-evaluation-harness task names run by eval.py."""
