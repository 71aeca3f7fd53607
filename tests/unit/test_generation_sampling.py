"""Token choice: top-k/top-p against `transformers`' warpers, greedy limits, seeds, statistics."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from megatron.errors import ConfigError
from megatron.generation.config import SamplingParams, TextgenArgs, batch_size, checked, token_dataset_prefixes
from megatron.generation.sampling import (
    choose_tokens,
    mask_vocab_padding,
    sample_generator,
    top_k_filter,
    top_p_filter,
)
from megatron.neox_arguments import NeoXArgs


def textgen_sampling(**keys: object) -> SamplingParams:
    """The sampling generate.py runs with these textgen keys (the others at their schema defaults)."""
    return TextgenArgs(**keys).sampling()  # type: ignore[arg-type]


def logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("k", [1, 3, 17, 50])
def test_top_k_keeps_what_transformers_keeps(k: int) -> None:
    x = logits()
    ours = top_k_filter(x, k)
    theirs = TopKLogitsWarper(k)(torch.zeros(x.shape[0], 1, dtype=torch.long), x.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert (~ours.isinf()).sum(dim=-1).tolist() == [k] * x.shape[0]


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.999])
def test_top_p_keeps_what_transformers_keeps(p: float) -> None:
    x = logits(seed=1)
    ours = top_p_filter(x, p)
    theirs = TopPLogitsWarper(p)(torch.zeros(x.shape[0], 1, dtype=torch.long), x.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())
    kept_mass = (torch.softmax(x, -1) * (~ours.isinf())).sum(-1)
    # the kept set reaches p, and without its least likely member it would not
    assert bool((kept_mass >= p - 1e-6).all())


def test_disabled_filters_change_nothing() -> None:
    x = logits()
    assert torch.equal(top_k_filter(x, 0), x) and torch.equal(top_p_filter(x, 0.0), x)


def greedy_tokens(x: torch.Tensor) -> list[int]:
    return x.argmax(-1).tolist()


@pytest.mark.parametrize("sampling", [textgen_sampling(top_k=1), textgen_sampling(top_p=1e-6),
                                      textgen_sampling(temperature=5.0, top_k=1), textgen_sampling(temperature=0.7, top_p=1e-9)])
def test_top_k_one_and_tiny_top_p_are_greedy(sampling: SamplingParams) -> None:
    x = logits(rows=20, seed=3)
    assert not sampling.greedy  # it really samples
    gens = [sample_generator(5, i) for i in range(20)]
    assert choose_tokens(x, sampling, gens).tolist() == greedy_tokens(x)


def test_greedy_is_argmax_without_randomness() -> None:
    x = logits(rows=10, seed=4)
    assert textgen_sampling().greedy
    assert choose_tokens(x, textgen_sampling(), [sample_generator(0, i) for i in range(10)]).tolist() == greedy_tokens(x)


def test_temperature_samples_depend_on_the_seed_only() -> None:
    x = torch.zeros(1, 1000)  # uniform: the draw is decided by the generator alone
    sampling = textgen_sampling(temperature=1.0)
    draws = {seed: [int(choose_tokens(x, sampling, [sample_generator(seed, i)])[0]) for i in range(8)]
             for seed in (1, 2)}
    again = [int(choose_tokens(x, sampling, [sample_generator(1, i)])[0]) for i in range(8)]
    assert draws[1] == again  # reproducible
    assert draws[1] != draws[2]  # another seed, other samples
    assert len(set(draws[1])) > 1  # and the index of the sample matters too


def test_sampled_frequencies_follow_the_tempered_softmax() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (1.0, 2.0):
        expected = torch.softmax(x / temperature, -1)[0]
        sampling = textgen_sampling(temperature=temperature)
        n = 4000
        counts = torch.zeros(4)
        for i in range(n):
            counts[int(choose_tokens(x, sampling, [sample_generator(11, i)])[0])] += 1
        # 4000 draws: each frequency within 4 standard errors of its probability
        stderr = (expected * (1 - expected) / n).sqrt()
        assert bool(((counts / n - expected).abs() < 4 * stderr + 1e-3).all()), (counts / n, expected)


def test_top_k_samples_only_from_the_k_best() -> None:
    x = logits(rows=1, vocab=30, seed=8)
    best = set(torch.topk(x[0], 3).indices.tolist())
    sampling = textgen_sampling(temperature=3.0, top_k=3)
    seen = {int(choose_tokens(x, sampling, [sample_generator(2, i)])[0]) for i in range(300)}
    assert seen == best


def test_padding_rows_are_never_chosen() -> None:
    x = logits(rows=4, vocab=16)
    x[:, 12:] = 100.0  # the padding rows would win
    masked = mask_vocab_padding(x, 12)
    assert choose_tokens(masked, textgen_sampling(), [sample_generator(0, i) for i in range(4)]).max() < 12
    sampled = choose_tokens(masked, textgen_sampling(temperature=1.0), [sample_generator(0, i) for i in range(4)])
    assert sampled.max() < 12


# --- the config ---------------------------------------------------------------------------------
def args(**changes: object) -> NeoXArgs:
    return NeoXArgs(seq_length=64, train_micro_batch_size_per_gpu=4, **changes)


def test_config_reads_every_textgen_key(tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    config = args(
        text_gen_type="input-file", sample_input_file=str(prompts), sample_output_file="o.jsonl", prompt_end="\n",
        temperature=0.5, top_k=7, top_p=0.9, maximum_tokens=11, recompute=True, return_logits=True, num_samples=3,
    )  # fmt: skip
    checked(config, config, config)
    assert config.sampling() == SamplingParams(temperature=0.5, top_k=7, top_p=0.9, maximum_tokens=11, recompute=True,
                                               return_logits=True)
    assert (config.prompts(), config.sample_output_file, config.num_samples, batch_size(config.train_micro_batch_size_per_gpu)) == (
        ["a", "b"], "o.jsonl", 3, 4)


def test_the_default_sampling_is_greedy_with_the_cache() -> None:
    """The schema's defaults are the only ones: generate.py without sampling keys decodes greedily, like lm-eval."""
    assert NeoXArgs().sampling() == SamplingParams.greedy_up_to(64) and NeoXArgs().sampling().greedy


@pytest.mark.parametrize(("changes", "message"), [
    ({}, "generate.py needs text_gen_type"),
    ({"text_gen_type": "input-file"}, "needs sample_input_file"),
    ({"text_gen_type": "input-file", "sample_input_file": "/no/such/file"}, "no such file"),
    ({"text_gen_type": "precompute", "data_path": "d"}, "needs precompute_model_name"),
    ({"text_gen_type": "precompute", "precompute_model_name": "ref", "use_dummy_dataset": True}, "use_dummy_dataset"),
])  # fmt: skip
def test_config_mistakes_name_the_key(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config = args(**changes)
        checked(config, config, config)


def test_precompute_lists_every_token_dataset_once() -> None:
    config = args(
        text_gen_type="precompute", precompute_model_name="ref", train_data_paths=["a", "b"], valid_data_paths=["a"],
        pos_train_data_paths=["p"], neg_train_data_paths=["n"], train_label_data_paths=["la", "lb"],
    )  # fmt: skip
    checked(config, config, config)
    assert token_dataset_prefixes(config) == ("a", "b", "p", "n")


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_input_file_without_prompts_is_refused_before_launch(tmp_path, text: str) -> None:
    """An empty (or blank) sample_input_file used to run and report 'wrote 0 completions'."""
    prompts = tmp_path / "empty.txt"
    prompts.write_text(text)
    with pytest.raises(ConfigError, match="empty.txt' holds no prompts"):
        config = args(text_gen_type="input-file", sample_input_file=str(prompts), prompt_end="\n")
        checked(config, config, config)
