"""Text generation and evaluation settings read by ``generate.py`` and ``eval.py``.

Both run the newest committed checkpoint of ``load`` (``iteration`` picks another) on the config's
parallel layout; ``train_micro_batch_size_per_gpu`` prompts or requests run together per replica.

Declared here, beside the generation that reads them (:class:`TextgenArgs`, one of the groups ``NeoXArgs`` is
composed of). generate.py also reads keys other components own (the context and seed: ``GPTConfig``; the token
datasets precompute scores: ``DataArgs``; the batch): each is read from the group that declares it, which the
arguments object is, so nothing is copied. Mistakes a user can make (an input file that does not exist, precompute
without a model name) are ``ConfigError``\ s naming the key, raised by :func:`checked` before launch and again
on the ranks before any model is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from megatron.config_schema import ArgGroup
from megatron.data.config import DataArgs
from megatron.errors import ConfigError
from megatron.model.config import GPTConfig

TextGenType = Literal["unconditional", "input-file", "interactive", "precompute"]


def read_prompts(path: str, prompt_end: str) -> list[str]:
    """The prompts of ``sample_input_file``: entries separated by ``prompt_end``, blank ones skipped."""
    with open(path, encoding="utf-8") as f:
        return [p for p in f.read().split(prompt_end) if p.strip()]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one request's next tokens are chosen, and how many are generated: a value, not a config.

    generate.py's requests all take :meth:`TextgenArgs.sampling` (the user's keys, whose defaults and docs live
    there, once); lm-eval builds one per request from the task's ``gen_kwargs``. So no field has a default here.

    Greedy (argmax) when ``temperature``, ``top_k`` and ``top_p`` are all 0; otherwise a sample from
    softmax(logits / T) restricted to the ``top_k`` most likely tokens and/or the smallest set whose
    probability reaches ``top_p``, with T = ``temperature`` (1 when it is 0). So ``top_k: 1`` and a tiny
    ``top_p`` both reduce to greedy decoding, as they should.
    """

    temperature: float
    top_k: int
    top_p: float
    maximum_tokens: int
    """Most tokens generated (fewer when the prompt leaves less room in the context)."""
    recompute: bool
    """Run the whole sequence for every new token instead of reusing cached keys/values."""
    return_logits: bool
    """Keep the (unfiltered, fp32) logits over the real vocabulary of every generated token."""

    @classmethod
    def greedy_up_to(cls, maximum_tokens: int) -> SamplingParams:
        """Argmax decoding of at most ``maximum_tokens`` tokens, with the cache and without logits (what
        lm-evaluation-harness asks by default)."""
        return cls(temperature=0.0, top_k=0, top_p=0.0, maximum_tokens=maximum_tokens, recompute=False,
                   return_logits=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and self.top_k == 0 and self.top_p == 0.0


class TextgenArgs(ArgGroup):
    """GPT-NeoX's ``NeoXArgsTextgen`` group."""

    text_gen_type: TextGenType | None = None
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
    """Where generated samples are written, one JSON object per line (prompt, text, tokens, ...): JSON
    lines whatever the name; the default is GPT-NeoX's (which writes JSON lines to it too: neox_args.py:1580,
    text_generation_utils.py:642 at ea7aefd), so name it ``.jsonl`` yourself."""

    num_samples: int = Field(1, ge=1)
    """Number of unconditional samples to draw."""

    recompute: bool = False
    """Recompute the whole sequence for every new token instead of using the key/value cache (slow;
    for checking the cache)."""

    def sampling(self) -> SamplingParams:
        """How generate.py chooses and counts the tokens of every prompt."""
        return SamplingParams(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                              maximum_tokens=int(self.maximum_tokens), recompute=bool(self.recompute),
                              return_logits=bool(self.return_logits))

    def prompts(self) -> list[str]:
        """The prompts of ``sample_input_file`` (input-file mode)."""
        if self.sample_input_file is None:
            raise ConfigError("text_gen_type=input-file needs sample_input_file: the file of prompts to complete")
        return read_prompts(self.sample_input_file, self.prompt_end)


def checked(args: TextgenArgs, data: DataArgs, model: GPTConfig) -> None:
    """A ``ConfigError`` naming the key unless generate.py can run (before launch, and on the ranks before the
    model is built): its own keys (``args``), the token datasets precompute scores (``data``) and the context
    (``model.seq_length``), each read from the group that declares it."""
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
        if not args.prompt_end:
            raise ConfigError("prompt_end must not be empty: it separates the prompts of sample_input_file")
        if not args.prompts():
            raise ConfigError(f"sample_input_file={args.sample_input_file!r} holds no prompts (it is empty or "
                              f"blank): write one prompt per {args.prompt_end!r}-separated entry")
    if kind == "precompute":
        if not args.precompute_model_name:
            raise ConfigError(
                "text_gen_type=precompute needs precompute_model_name: the reference log-probs are written "
                "next to each dataset as <prefix>_<precompute_model_name>.bin/.idx"
            )
        if not token_dataset_prefixes(data):
            what = "use_dummy_dataset" if data.use_dummy_dataset else "train_urls" if data.train_urls else None
            raise ConfigError(
                "text_gen_type=precompute scores the token datasets of data_path or {train,valid,test}_data_paths "
                "(pos_/neg_ for preference pairs), and this config has none"
                + (f" ({what} has no files to write reference log-probs next to)" if what else "")
            )
    if model.seq_length is None:
        raise ConfigError("seq_length must be set: it bounds prompt + generated tokens")
    args.sampling()


def batch_size(train_micro_batch_size_per_gpu: int | None) -> int:
    """Prompts (documents, for precompute; requests, for lm-eval) run together on a replica: the training
    micro-batch (at least 1). The key is the DeepSpeed group's (``neox_arguments``, above this package),
    so callers pass its value."""
    return max(1, int(train_micro_batch_size_per_gpu or 1))


def token_dataset_prefixes(args: DataArgs) -> tuple[str, ...]:
    """Every token dataset a run of this config reads (labels and rewards are no tokens), once each: what
    precompute scores."""
    lists = (
        [args.data_path] if args.data_path else [],
        args.train_data_paths, args.valid_data_paths, args.test_data_paths,
        args.pos_train_data_paths, args.neg_train_data_paths,
        args.pos_valid_data_paths, args.neg_valid_data_paths,
        args.pos_test_data_paths, args.neg_test_data_paths,
    )  # fmt: skip
    return tuple(dict.fromkeys(prefix for paths in lists for prefix in paths or []))
