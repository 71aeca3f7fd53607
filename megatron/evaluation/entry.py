"""eval.py's work on each rank: run the lm-eval tasks on the loaded model, rank 0 writes the results.

Reading the resolved config file and loading the checkpoint's model is the rank's program's
(``megatron/app/workers.py``); this module receives the typed :class:`EvalRun` and the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.evaluation.config import EvalRun
from megatron.generation.config import SamplingParams

if TYPE_CHECKING:
    from megatron.generation.entry import InferenceModel


def evaluate_checkpoint(config: EvalRun, model: InferenceModel, checkpoint: str | None) -> None:
    """The tasks of ``config`` on ``model``, loaded from ``checkpoint`` (``load``, named in the results)."""
    # lazy: lm-eval, torch and DeepSpeed load after the config is checked
    from megatron.evaluation.harness import evaluate, write_results
    from megatron.evaluation.lm_eval_adapter import DeepyLM
    from megatron.generation.modes import TextGenerator, is_rank0

    generator = TextGenerator(
        replica=model.replica,
        tokenizer=model.tokenizer,
        sampling=SamplingParams.greedy_up_to(config.textgen.maximum_tokens),
        seq_length=int(config.model.seq_length or 0),
        batch_size=config.batch_size,
        seed=config.model.seed,
    )
    results = evaluate(DeepyLM(generator), config)
    if is_rank0():
        write_results(results, config, checkpoint=checkpoint, step=model.step, run_name=model.run_name)
