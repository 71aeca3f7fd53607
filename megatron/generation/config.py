"""What generate.py reads from the user's config, as frozen typed records.

`GenerationConfig.from_args(args)` is the only place that reads the textgen keys
(`megatron/neox_arguments/groups/textgen.py` holds their defaults and docs). Mistakes a user can
make with them (an input file that does not exist, precompute without a model name) are
`ConfigError`s naming the key, raised before any model is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron.errors import ConfigError

if TYPE_CHECKING:
    from megatron.neox_arguments import NeoXArgs

TextGenType = Literal["unconditional", "input-file", "interactive", "precompute"]


def read_prompts(path: str, prompt_end: str) -> list[str]:
    """The prompts of ``sample_input_file``: entries separated by ``prompt_end``, blank ones skipped."""
    with open(path, encoding="utf-8") as f:
        return [p for p in f.read().split(prompt_end) if p.strip()]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    """How the next token is chosen, and how many are generated.

    Greedy (argmax) when `temperature`, `top_k` and `top_p` are all 0; otherwise a sample from
    softmax(logits / T) restricted to the `top_k` most likely tokens and/or the smallest set whose
    probability reaches `top_p`, with T = `temperature` (1 when it is 0). So `top_k: 1` and a tiny
    `top_p` both reduce to greedy decoding, as they should.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    maximum_tokens: int = 64
    """Most tokens generated per prompt (fewer when the prompt leaves less room in `seq_length`)."""
    recompute: bool = False
    """Run the whole sequence for every new token instead of reusing cached keys/values."""
    return_logits: bool = False
    """Keep the (unfiltered, fp32) logits over the real vocabulary of every generated token."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and self.top_k == 0 and self.top_p == 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationConfig:
    """Everything generate.py needs besides the model and the tokenizer."""

    text_gen_type: TextGenType
    sampling: SamplingConfig
    seq_length: int
    """The model's context: prompt + generated tokens never exceed it."""
    batch_size: int
    """Prompts (or documents, for precompute) run together; `train_micro_batch_size_per_gpu`."""
    seed: int
    """Sample i is drawn with its own generator seeded from (seed, i): the same samples on any layout."""
    num_samples: int = 1
    sample_input_file: str | None = None
    sample_output_file: str = "samples.txt"
    prompt_end: str = "\n"
    precompute_model_name: str | None = None
    data_prefixes: tuple[str, ...] = ()
    """Token datasets that precompute scores: data_path and every per-split (pos_/neg_) path."""

    @classmethod
    def from_args(cls, args: NeoXArgs) -> GenerationConfig:
        kind = args.text_gen_type
        if kind is None:
            raise ConfigError(
                "generate.py needs text_gen_type: one of unconditional, input-file, interactive, precompute "
                "(e.g. add text_gen_type=unconditional to the command line)"
            )
        if kind == "input-file":
            if not args.sample_input_file:
                raise ConfigError("text_gen_type=input-file needs sample_input_file: the file of prompts to complete")
            if not os.path.isfile(args.sample_input_file):
                raise ConfigError(f"sample_input_file={args.sample_input_file!r}: no such file")
        if kind == "precompute" and not args.precompute_model_name:
            raise ConfigError(
                "text_gen_type=precompute needs precompute_model_name: the reference log-probs are written "
                "next to each dataset as <prefix>_<precompute_model_name>.bin/.idx"
            )
        if kind == "input-file" and not args.prompt_end:
            raise ConfigError("prompt_end must not be empty: it separates the prompts of sample_input_file")
        if kind == "input-file" and not read_prompts(args.sample_input_file, args.prompt_end):
            raise ConfigError(f"sample_input_file={args.sample_input_file!r} holds no prompts (it is empty or "
                              f"blank): write one prompt per {args.prompt_end!r}-separated entry")
        prefixes = _token_dataset_prefixes(args) if kind == "precompute" else ()
        if kind == "precompute" and not prefixes:
            what = "use_dummy_dataset" if args.use_dummy_dataset else "train_urls" if args.train_urls else None
            raise ConfigError(
                "text_gen_type=precompute scores the token datasets of data_path or {train,valid,test}_data_paths "
                "(pos_/neg_ for preference pairs), and this config has none"
                + (f" ({what} has no files to write reference log-probs next to)" if what else "")
            )
        if args.seq_length is None:
            raise ConfigError("seq_length must be set: it bounds prompt + generated tokens")
        sampling = SamplingConfig(
            temperature=float(args.temperature),
            top_k=int(args.top_k),
            top_p=float(args.top_p),
            maximum_tokens=int(args.maximum_tokens),
            recompute=bool(args.recompute),
            return_logits=bool(args.return_logits),
        )
        return cls(
            text_gen_type=kind,
            sampling=sampling,
            seq_length=int(args.seq_length),
            batch_size=max(1, int(args.train_micro_batch_size_per_gpu or 1)),
            seed=int(args.seed),
            num_samples=int(args.num_samples),
            sample_input_file=args.sample_input_file,
            sample_output_file=args.sample_output_file,
            prompt_end=args.prompt_end,
            precompute_model_name=args.precompute_model_name,
            data_prefixes=prefixes,
        )


def _token_dataset_prefixes(args: NeoXArgs) -> tuple[str, ...]:
    """Every token dataset a run of this config reads (labels and rewards are no tokens), once each."""
    lists = (
        [args.data_path] if args.data_path else [],
        args.train_data_paths, args.valid_data_paths, args.test_data_paths,
        args.pos_train_data_paths, args.neg_train_data_paths,
        args.pos_valid_data_paths, args.neg_valid_data_paths,
        args.pos_test_data_paths, args.neg_test_data_paths,
    )  # fmt: skip
    return tuple(dict.fromkeys(prefix for paths in lists for prefix in paths or []))
