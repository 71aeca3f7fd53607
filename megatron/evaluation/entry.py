"""eval.py's work on each rank: load the model, run the lm-eval tasks, rank 0 writes the results."""

from __future__ import annotations

from megatron.evaluation.config import checked
from megatron.generation.config import SamplingParams


def main(argv: list[str]) -> int:
    from megatron.evaluation.harness import evaluate, write_results
    from megatron.evaluation.lm_eval_adapter import DeepyLM
    from megatron.generation.entry import build_inference_model, parse_worker_argv
    from megatron.generation.modes import TextGenerator, is_rank0
    from megatron.neox_arguments import load_resolved
    from megatron.neox_arguments.arguments import evaluation_run

    options = parse_worker_argv(argv, "Deepy evaluation with lm-evaluation-harness (started by deepy.py on each rank)")
    args = load_resolved(options.deepy_config).args
    config = checked(evaluation_run(args))  # a wrong key fails before the model is built
    model = build_inference_model(args, "eval.py")
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
        write_results(results, config, checkpoint=args.load, step=model.step, run_name=model.run_name)
    return 0
