"""What eval.py reads from the user's config, as one frozen typed record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron.errors import ConfigError

if TYPE_CHECKING:
    from megatron.neox_arguments import NeoXArgs


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    tasks: tuple[str, ...]
    """lm-evaluation-harness task names, or paths of task YAML files (or directories of them)."""
    results_prefix: str
    """`<prefix>_eval_results.json` (and `<prefix>_eval_samples_<task>.jsonl`); empty = in `log_dir`."""
    log_dir: str | None
    """Where metrics.jsonl gets one `lm_eval/<task>/<metric>` row."""
    seq_length: int
    """The model's context: longer inputs keep their last `seq_length` tokens."""
    batch_size: int
    """Requests run together on a replica (`train_micro_batch_size_per_gpu`)."""
    max_gen_tokens: int
    """Tokens generated per request when a generate_until task sets no `max_gen_toks` (`maximum_tokens`)."""
    seed: int

    @classmethod
    def from_args(cls, args: NeoXArgs) -> EvalConfig:
        if not args.eval_tasks:
            raise ConfigError(
                "eval.py needs eval_tasks: lm-evaluation-harness task names or task YAML paths, "
                "e.g. eval_tasks=[lambada_openai] or eval_tasks=[my_tasks/task.yaml]"
            )
        if args.seq_length is None:
            raise ConfigError("seq_length must be set: it is the context the evaluated model reads")
        return cls(
            tasks=tuple(args.eval_tasks),
            results_prefix=args.eval_results_prefix,
            log_dir=args.log_dir,
            seq_length=int(args.seq_length),
            batch_size=max(1, int(args.train_micro_batch_size_per_gpu or 1)),
            max_gen_tokens=int(args.maximum_tokens),
            seed=int(args.seed),
        )
