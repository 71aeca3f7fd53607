"""eval.py's work on each rank: load the model, run the lm-eval tasks, rank 0 writes the results."""

from __future__ import annotations

from megatron.evaluation.config import checked
from megatron.generation.config import SamplingParams, batch_size


def main(argv: list[str]) -> int:
    from megatron.evaluation.harness import evaluate, write_results
    from megatron.evaluation.lm_eval_adapter import DeepyLM
    from megatron.generation.entry import build_inference_model, parse_worker_argv
    from megatron.generation.modes import TextGenerator, is_rank0
    from megatron.neox_arguments import load_resolved

    options = parse_worker_argv(argv, "Deepy evaluation with lm-evaluation-harness (started by deepy.py on each rank)")
    args = load_resolved(options.deepy_config).args
    config = checked(args)  # a wrong key fails before the model is built
    model = build_inference_model(args, "eval.py")
    generator = TextGenerator(
        replica=model.replica,
        tokenizer=model.tokenizer,
        sampling=SamplingParams.greedy_up_to(config.maximum_tokens),
        seq_length=int(config.seq_length or 0),
        batch_size=batch_size(config.train_micro_batch_size_per_gpu),
        seed=config.seed,
    )
    results = evaluate(DeepyLM(generator), config)
    if is_rank0():
        write_results(results, config, checkpoint=args.load, step=model.step, run_name=model.run_name)
    return 0
