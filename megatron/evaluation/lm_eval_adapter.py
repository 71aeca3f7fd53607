"""Our model as an lm-evaluation-harness `LM`: loglikelihood, loglikelihood_rolling, generate_until.

Data parallelism is done here, not by the harness: every rank runs the harness over the whole task
(building requests and computing metrics is cheap), and each request method hands request i to
data-parallel replica i mod dp, runs that share on the replica's tensor x pipeline ranks and gathers
all answers on every rank. So the harness sees one process (`rank` 0, `world_size` 1) wherever it
runs, the ranks of one replica always work on the same requests, and every rank returns the same
complete answers (rank 0 then writes them).

Tokenisation follows the harness' Hugging Face model (`lm_eval.models.huggingface`): trailing spaces
of a context move to the front of its continuation, the continuation's tokens are those of
context + continuation beyond the context's, an empty context is the EOD token, and inputs longer
than the model's context keep their last `seq_length` tokens.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.generation.config import SamplingParams
from megatron.generation.modes import TextGenerator
from megatron.generation.scoring import ScoreRequest, Scored, score


class DeepyLM(LM):
    def __init__(self, generator: TextGenerator) -> None:
        super().__init__()
        self.gen = generator
        self.tokenizer = generator.tokenizer
        self.replica = generator.replica
        self.max_length = generator.seq_length
        self.eod = generator.tokenizer.eod
        self.default_max_gen_tokens = generator.sampling.maximum_tokens
        """For generate_until requests whose task sets no `max_gen_toks`."""

    # --- tokenisation ---------------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.eod], self.tokenizer.tokenize(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation = context[-spaces:] + continuation
            context = context[:-spaces]
        whole = self.tokenizer.tokenize(context + continuation)
        context_tokens = self.tokenizer.tokenize(context)
        return context_tokens, whole[len(context_tokens) :]

    def _fit(self, context: list[int], continuation: list[int]) -> ScoreRequest:
        """context + continuation cut to the model's context (+1: the last token is only a target)."""
        tokens = (context + continuation)[-(self.max_length + 1) :]
        return tokens, max(1, len(tokens) - len(continuation))

    # --- data parallelism -----------------------------------------------------------------------
    def _score_all(self, requests: list[ScoreRequest]) -> list[Scored]:
        dp, rank = self.replica.dp_size, self.replica.dp_rank
        mine = [i for i in range(len(requests)) if i % dp == rank]
        scored = score(self.replica, [requests[i] for i in mine], batch_size=self.gen.batch_size,
                       max_length=self.max_length, eod=self.eod)
        merged: dict[int, Scored] = {}
        for part in self.replica.gather_over_replicas(dict(zip(mine, scored))):
            merged.update(part)
        return [merged[i] for i in range(len(requests))]

    # --- the three request types -----------------------------------------------------------------
    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding would produce the continuation)."""
        fitted = [self._fit(*self._encode_pair(*req.args)) for req in requests]
        answers = [(result.total, all(result.greedy)) for result in self._score_all(fitted)]
        for req, answer in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood", req.args, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        """log p(text): every token scored once, each window with as much context as fits."""
        windows: list[ScoreRequest] = []
        owners: list[int] = []
        for i, req in enumerate(requests):
            tokens = self.tokenizer.tokenize(req.args[0])
            pairs = get_rolling_token_windows(token_list=tokens, prefix_token=self.eod, max_seq_len=self.max_length,
                                              context_len=1)
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((list(context) + list(continuation), len(context)))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, result in zip(owners, self._score_all(windows)):
            totals[owner] += result.total
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Greedy (or, with `do_sample`, sampled) continuations, cut before the first stop string."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        settings: list[tuple[SamplingParams, list[str]]] = []
        for i, req in enumerate(requests):
            sampling, until = self._settings(req.args[1])
            settings.append((sampling, until))
            groups.setdefault((sampling, tuple(until)), []).append(i)
        answers = [""] * len(requests)
        for (sampling, _), indices in groups.items():
            room = max(1, self.max_length - sampling.maximum_tokens)
            prompts = [self.tokenizer.tokenize(requests[i].args[0])[-room:] for i in indices]
            stops = [settings[i][1] for i in indices]

            def stop(index: int, tokens: list[int], stops: list[list[str]] = stops) -> bool:
                text = self.tokenizer.detokenize(tokens)
                return any(s in text for s in stops[index])

            for i, generated in zip(indices, self.gen.complete(prompts, sampling, stop)):
                answers[i] = _cut(self.tokenizer.detokenize(generated.tokens), settings[i][1])
        for req, answer in zip(requests, answers):
            self.cache_hook.add_partial("generate_until", req.args, answer)
        return answers

    def _settings(self, gen_kwargs: dict[str, Any]) -> tuple[SamplingParams, list[str]]:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        maximum = int(kwargs.pop("max_gen_toks", self.default_max_gen_tokens))
        if kwargs.pop("do_sample", False):
            temperature = float(kwargs.pop("temperature", 1.0) or 1.0)
            sampling = SamplingParams(temperature=temperature, top_k=int(kwargs.pop("top_k", 0) or 0),
                                      top_p=float(kwargs.pop("top_p", 0.0) or 0.0), maximum_tokens=maximum,
                                      recompute=False, return_logits=False)
        else:
            sampling = SamplingParams.greedy_up_to(maximum)  # greedy, as the harness asks by default
        return sampling, until


def _cut(text: str, until: list[str]) -> str:
    """`text` up to (not including) the earliest stop string."""
    ends = [text.find(s) for s in until if s and s in text]
    return text[: min(ends)] if ends else text
