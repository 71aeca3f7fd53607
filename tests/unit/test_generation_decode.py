"""Decoding, scoring, precompute and the lm-eval adapter on a small in-process model (one rank).

The references are computed independently: a plain full forward of `GPTModel` with
`log_softmax`, and the training loss `lm_loss`. Multi-rank behaviour (tp, pp, dp) is covered end to
end in tests/e2e/test_generate.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, data_file_path, index_file_path
from megatron.errors import DataError
from megatron.data.reference_logprobs import open_reference_logprobs
from megatron.evaluation.lm_eval_adapter import DeepyLM
from megatron.generation.config import SamplingParams, TextgenArgs
from megatron.generation.decode import generate
from megatron.generation.config import read_prompts
from megatron.generation.modes import TextGenerator, run_unconditional
from megatron.generation.precompute import (
    _part_prefix,
    join_parts,
    precompute_dataset,
    reference_logprobs_prefix,
    sequence_logprobs,
    write_part,
)
from megatron.generation.replica import ModelReplica
from megatron.generation.sampling import sample_generator
from megatron.generation.scoring import score
from megatron.model import GPTConfig, GPTModel, lm_loss
from megatron.tokenizer.base import Tokenizer


def textgen_sampling(**keys: object) -> SamplingParams:
    """The sampling generate.py runs with these textgen keys (the others at their schema defaults)."""
    return TextgenArgs(**keys).sampling()  # type: ignore[arg-type]

SEQ = 24
VOCAB = 30  # real tokens; the model has 32 rows, so 2 are tensor-parallel padding
EOD = 0


class LetterTokenizer(Tokenizer):
    """0 = EOD, then space, '.', a-z: small enough for a tiny model, real text for lm-eval."""

    name = "letters"
    alphabet = " .abcdefghijklmnopqrstuvwxyz"

    @property
    def vocab_size(self) -> int:
        return VOCAB

    @property
    def eod(self) -> int:
        return EOD

    def tokenize(self, text: str) -> list[int]:
        return [self.alphabet.index(c) + 1 for c in text.lower() if c in self.alphabet]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i - 1] for i in ids if 0 < i <= len(self.alphabet))


@pytest.fixture(scope="module")
def model() -> GPTModel:
    torch.manual_seed(0)
    # a large init std makes the logits peaked, so greedy choices are far from ties
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, padded_vocab_size=32,
                       pos_emb="rotary", init_method_std=0.3, seed=3)
    return GPTModel(config).eval()


@pytest.fixture(scope="module")
def replica(model: GPTModel) -> ModelReplica:
    return ModelReplica(model, vocab_size=VOCAB, hidden_size=32)


def run(replica: ModelReplica, prompts: list[list[int]], sampling: SamplingParams, seed: int = 1, **kw):
    return generate(replica, prompts, sampling, eod=EOD, max_length=SEQ,
                    generators=[sample_generator(seed, i) for i in range(len(prompts))], **kw)


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [], [3, 4, 12, 13, 14, 15, 16, 17, 18]]


def full_forward_greedy(model: GPTModel, prompt: list[int], n: int) -> list[int]:
    """Reference: no cache, no batching, argmax over the real vocabulary."""
    tokens = list(prompt) or [EOD]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens]))[0, -1, :VOCAB]
            out.append(int(logits.argmax()))
            tokens.append(out[-1])
    return out


def test_cached_batched_greedy_equals_full_forward(model: GPTModel, replica: ModelReplica) -> None:
    cached = run(replica, PROMPTS, textgen_sampling(maximum_tokens=10))
    for prompt, got in zip(PROMPTS, cached):
        want = full_forward_greedy(model, prompt, 10)
        cut = want.index(EOD) if EOD in want else len(want)
        assert got.tokens == want[:cut]
        assert got.finished == (cut < 10)


def test_cache_and_recompute_give_the_same_logits(replica: ModelReplica) -> None:
    cached = run(replica, PROMPTS, textgen_sampling(maximum_tokens=8, return_logits=True))
    recomputed = run(replica, PROMPTS, textgen_sampling(maximum_tokens=8, return_logits=True, recompute=True))
    for a, b in zip(cached, recomputed):
        assert a.tokens == b.tokens
        assert a.logits is not None and b.logits is not None and len(a.logits) == len(a.tokens)
        assert np.allclose(np.array(a.logits), np.array(b.logits), atol=1e-5)
        assert all(len(step) == VOCAB for step in a.logits)  # the real vocabulary only
        assert [int(np.argmax(step)) for step in a.logits] == a.tokens  # greedy: the argmax was taken


def test_rows_of_a_batch_equal_rows_alone_even_when_sampling(replica: ModelReplica) -> None:
    sampling = textgen_sampling(temperature=1.0, maximum_tokens=8)
    batched = run(replica, PROMPTS, sampling, seed=5)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(replica, [prompt], sampling, eod=EOD, max_length=SEQ, generators=[sample_generator(5, i)])
        assert alone[0].tokens == batched[i].tokens
    other_seed = run(replica, PROMPTS, sampling, seed=6)
    assert [g.tokens for g in other_seed] != [g.tokens for g in batched]


def test_top_k_one_and_tiny_top_p_generate_greedily(replica: ModelReplica) -> None:
    greedy = [g.tokens for g in run(replica, PROMPTS, textgen_sampling(maximum_tokens=8))]
    assert [g.tokens for g in run(replica, PROMPTS, textgen_sampling(top_k=1, temperature=2.0, maximum_tokens=8))] == greedy
    assert [g.tokens for g in run(replica, PROMPTS, textgen_sampling(top_p=1e-6, maximum_tokens=8))] == greedy


def test_generation_stops_at_eod(replica: ModelReplica) -> None:
    free = run(replica, [[5, 6, 7]], textgen_sampling(maximum_tokens=8))[0]
    assert not free.finished and len(free.tokens) == 8
    # make the model's third token the end-of-document token: it must stop right there
    stop_token = free.tokens[2]
    first = free.tokens.index(stop_token)
    stopped = generate(replica, [[5, 6, 7]], textgen_sampling(maximum_tokens=8), eod=stop_token, max_length=SEQ,
                       generators=[sample_generator(1, 0)])[0]
    assert stopped.finished and stopped.tokens == free.tokens[:first]


def test_stop_condition_and_token_budgets(replica: ModelReplica) -> None:
    got = run(replica, PROMPTS, textgen_sampling(maximum_tokens=6), stop=lambda i, toks: i == 1 and len(toks) == 2)
    assert got[1].finished and len(got[1].tokens) == 2
    assert len(got[0].tokens) == 6 or got[0].finished
    long_prompt = list(range(1, 23))  # 22 tokens: only SEQ - 22 = 2 fit
    limited = run(replica, [long_prompt], textgen_sampling(maximum_tokens=6))[0]
    assert len(limited.tokens) <= 2
    too_long = run(replica, [list(range(1, 29)) + [1, 2]], textgen_sampling(maximum_tokens=6))[0]
    assert len(too_long.prompt) == SEQ - 1 and too_long.prompt == (list(range(1, 29)) + [1, 2])[-(SEQ - 1):]


def test_unconditional_mode_writes_jsonl_and_prints(tmp_path, replica: ModelReplica, capsys) -> None:
    from megatron.neox_arguments import NeoXArgs

    gen = TextGenerator(replica=replica, tokenizer=LetterTokenizer(), sampling=textgen_sampling(temperature=1.0,
                        maximum_tokens=6), seq_length=SEQ, batch_size=2, seed=9)  # fmt: skip
    config = NeoXArgs(text_gen_type="unconditional", num_samples=3, sample_output_file=str(tmp_path / "s.jsonl"))
    rows = run_unconditional(gen, config)
    import json

    written = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert written == rows and len(rows) == 3
    assert all(set(r) == {"prompt", "text", "tokens", "length", "finished"} for r in rows)
    assert all(r["text"] == LetterTokenizer().detokenize(r["tokens"]) for r in rows)
    assert len({tuple(r["tokens"]) for r in rows}) > 1  # sampled with a generator per sample
    printed = capsys.readouterr().out
    assert "--- sample 3/3" in printed and rows[0]["text"] in printed


def test_read_prompts_splits_on_prompt_end(tmp_path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("one<END>two\nlines<END>\n<END>three")
    assert read_prompts(str(path), "<END>") == ["one", "two\nlines", "three"]


# --- scoring -------------------------------------------------------------------------------------
def reference_logprobs(model: GPTModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]))[0]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1))[:, 0]


def test_score_is_minus_the_training_loss(model: GPTModel, replica: ModelReplica) -> None:
    seqs = [[1, 5, 6, 7, 8, 9, 10], [2, 3], [4, 4, 4, 4, 20, 21, 22, 23, 24, 1, 2, 3]]
    results = score(replica, [(s, 1) for s in seqs] + [(seqs[2], 5)], batch_size=2, max_length=SEQ, eod=EOD)
    for tokens, result in zip(seqs, results):
        want = reference_logprobs(model, tokens)
        assert np.allclose(result.logprobs, want.numpy(), atol=1e-5)
        with torch.no_grad():
            loss = lm_loss(model(torch.tensor([tokens[:-1]])), torch.tensor([tokens[1:]]))
        assert abs(-result.total / (len(tokens) - 1) - float(loss)) < 1e-5
        with torch.no_grad():
            argmax = model(torch.tensor([tokens[:-1]]))[0, :, :VOCAB].argmax(-1)
        assert result.greedy == (argmax == torch.tensor(tokens[1:])).tolist()
    assert np.allclose(results[3].logprobs, results[2].logprobs[4:], atol=1e-6)


# --- precompute ----------------------------------------------------------------------------------
def write_tokens(prefix: str, docs: list[list[int]]) -> None:
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), np.uint16)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(index_file_path(prefix))


DOCS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 6, [3, 3, 3, 0], []]


def test_long_sequences_are_scored_in_windows(model: GPTModel, replica: ModelReplica) -> None:
    long = DOCS[2]  # 54 tokens: windows of SEQ inputs
    values = sequence_logprobs(replica, [long], batch_size=4, max_length=SEQ, eod=EOD)[0]
    assert len(values) == len(long) and values[0] == 0.0
    for start in range(0, len(long) - 1, SEQ):
        window = long[start : start + SEQ + 1]
        assert np.allclose(values[start + 1 : start + len(window)], reference_logprobs(model, window).numpy(),
                           atol=1e-5)


def test_precompute_writes_an_aligned_float32_dataset(tmp_path, replica: ModelReplica) -> None:
    prefix = str(tmp_path / "docs_text_document")
    write_tokens(prefix, DOCS)
    out = precompute_dataset(replica, prefix, "ref", batch_size=2, max_length=SEQ, eod=EOD)
    assert out == reference_logprobs_prefix(prefix, "ref") == prefix + "_ref"
    ref = open_reference_logprobs(prefix, "ref")
    want = sequence_logprobs(replica, [list(d) for d in DOCS], batch_size=3, max_length=SEQ, eod=EOD)
    for i in range(len(DOCS)):
        assert ref[i].dtype == np.float32 and np.allclose(ref[i], want[i], atol=1e-5)  # other batches

    # two data-parallel replicas write a block each; the join equals the one-replica dataset
    tokens = MMapIndexedDataset(prefix)
    other = str(tmp_path / "other")
    for rank, (lo, hi) in enumerate([(0, 2), (2, len(DOCS))]):
        replica.dp_rank, replica.dp_size = rank, 2
        try:
            write_part(replica, tokens, other, lo, hi, batch_size=2, max_length=SEQ, eod=EOD)
        finally:
            replica.dp_rank, replica.dp_size = 0, 1
    join_parts(tokens, other, 2, seq_length=SEQ)
    joined = MMapIndexedDataset(other)
    assert all(np.allclose(joined[i], ref[i], atol=1e-5) for i in range(len(DOCS)))
    assert np.array_equal(joined.doc_idx, tokens.doc_idx)
    assert not list(tmp_path.glob(f"{_part_prefix('other', 0)}*"))

    # the context they were scored with is recorded; a run reading more of the 54-token sequence is refused
    assert json.loads(Path(out + ".json").read_text()) == {"seq_length": SEQ}
    assert open_reference_logprobs(prefix, "ref", seq_length=SEQ) is not None
    with pytest.raises(DataError, match=f"computed at seq_length {SEQ} .* up to 49 tokens at seq_length 48"):
        open_reference_logprobs(prefix, "ref", seq_length=2 * SEQ)


def test_dry_run_refuses_reference_log_probs_scored_with_less_context(tmp_path, capsys) -> None:
    """Issue 30 item 9: precompute at 8, train at 32 on 20-token pairs gave step-1 loss 0.709, not ln 2."""
    from megatron.app.deepy import main
    from megatron.data.reference_logprobs import write_record
    from megatron.errors import run_guarded

    sides = {"chosen": [[5 + i % 7 for i in range(20)]] * 4, "rejected": [[40 + i % 5 for i in range(20)]] * 4}
    for side, docs in sides.items():
        write_tokens(str(tmp_path / side), docs)
        builder = MMapIndexedDatasetBuilder(data_file_path(str(tmp_path / f"{side}_ref")), np.float32)
        for doc in docs:
            builder.add_item(np.zeros(len(doc), np.float32))
            builder.end_document()
        builder.finalize(index_file_path(str(tmp_path / f"{side}_ref")))
    config = tmp_path / "run.yml"
    config.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\ntrain_iters: 2\n"
                      "lr: 0.001\ntrain_micro_batch_size_per_gpu: 2\nnum_gpus: 1\ntokenizer_type: CharLevelTokenizer\n"
                      "train_impl: dpo\ndataset_impl: pairwise\npack_impl: unpacked\nreference_logps: ref\n"
                      f"pos_train_data_paths: [{tmp_path / 'chosen'}]\nneg_train_data_paths: [{tmp_path / 'rejected'}]\n")
    argv = ["--dry-run", str(Path(__file__).resolve().parents[2] / "train.py"), str(config)]

    def dry_run() -> tuple[int, str]:
        with pytest.raises(SystemExit) as done:
            run_guarded(lambda: main(argv), argv=argv)
        out = capsys.readouterr()
        return int(done.value.code or 0), out.out + out.err

    code, out = dry_run()  # no record: an older precompute, context unknown
    assert code == 2 and "is missing, so the context the values were scored with is unknown" in out, out
    for side in sides:
        write_record(str(tmp_path / f"{side}_ref"), 8)
    code, out = dry_run()
    assert code == 2 and "Traceback" not in out, out
    assert f"reference_logps='ref' ({config}:13) with seq_length=32 ({config}:4)" in out, out
    assert "computed at seq_length 8" in out and "sequences of up to 20 tokens" in out, out
    for side in sides:
        write_record(str(tmp_path / f"{side}_ref"), 19)  # covers every token the run reads (20-token pairs)
    assert dry_run()[0] == 0


def test_reader_refuses_missing_or_misaligned_log_probs(tmp_path) -> None:
    prefix = str(tmp_path / "d")
    write_tokens(prefix, DOCS)
    with pytest.raises(DataError, match="text_gen_type=precompute precompute_model_name=gpt"):
        open_reference_logprobs(prefix, "gpt")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix + "_gpt"), np.float32)
    for doc in DOCS[:-1]:
        builder.add_item(np.zeros(len(doc), np.float32))
        builder.end_document()
    builder.finalize(index_file_path(prefix + "_gpt"))
    with pytest.raises(DataError, match="not aligned"):
        open_reference_logprobs(prefix, "gpt")


# --- the lm-eval adapter -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(replica: ModelReplica) -> DeepyLM:
    gen = TextGenerator(replica=replica, tokenizer=LetterTokenizer(), sampling=textgen_sampling(maximum_tokens=12),
                        seq_length=SEQ, batch_size=2, seed=1)
    return DeepyLM(gen)


def request(kind: str, *arguments: object) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=0)  # type: ignore[arg-type]


def loss_sum(model: GPTModel, tokens: list[int], from_index: int) -> float:
    """-(sum of the training loss) over targets tokens[from_index:], computed with lm_loss."""
    labels = torch.tensor([tokens[1:]])
    labels[0, : from_index - 1] = -100
    with torch.no_grad():
        mean = lm_loss(model(torch.tensor([tokens[:-1]])), labels)
    return -float(mean) * (len(tokens) - from_index)


def test_loglikelihood_equals_the_model_loss(model: GPTModel, lm: DeepyLM) -> None:
    tok = LetterTokenizer()
    pairs = [("the cat sat", " on the mat"), ("a dog ", "barks."), ("", "hello")]
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    # the trailing space of "a dog " moves to the continuation
    expected_inputs = [(tok.tokenize("the cat sat"), tok.tokenize(" on the mat")),
                       (tok.tokenize("a dog"), tok.tokenize(" barks.")), ([EOD], tok.tokenize("hello"))]
    for (ll, greedy), (context, continuation) in zip(got, expected_inputs):
        tokens = context + continuation
        assert abs(ll - loss_sum(model, tokens, len(context))) < 1e-4
        with torch.no_grad():
            argmax = model(torch.tensor([tokens[:-1]]))[0, len(context) - 1 :, :VOCAB].argmax(-1)
        assert greedy == bool((argmax == torch.tensor(continuation)).all())


def test_loglikelihood_keeps_the_last_seq_length_tokens(model: GPTModel, lm: DeepyLM) -> None:
    tok = LetterTokenizer()
    context = "abcdefghij klmnopqrst uvwxyz"  # 28 tokens + 4 > SEQ + 1
    (ll, _), = lm.loglikelihood([request("loglikelihood", context, " abc")])
    tokens = (tok.tokenize(context) + tok.tokenize(" abc"))[-(SEQ + 1):]
    assert abs(ll - loss_sum(model, tokens, len(tokens) - 4)) < 1e-4


def test_loglikelihood_rolling_scores_every_token_once(model: GPTModel, lm: DeepyLM) -> None:
    tok = LetterTokenizer()
    short, long = "the cat sat.", "the quick brown fox jumps over the lazy dog again and again."
    got = lm.loglikelihood_rolling([request("loglikelihood_rolling", short), request("loglikelihood_rolling", long)])
    assert abs(got[0] - loss_sum(model, [EOD] + tok.tokenize(short), 1)) < 1e-4
    tokens = [EOD] + tok.tokenize(long)
    # windows of SEQ predictions; each later window re-reads as much context as fits
    total, predicted = 0.0, 0
    while predicted < len(tokens) - 1:
        end = min(predicted + SEQ, len(tokens) - 1)
        window = tokens[max(0, end - SEQ) : end + 1]
        first_target = len(window) - (end - predicted)
        total += loss_sum(model, window, first_target)
        predicted = end
    assert abs(got[1] - total) < 1e-3


def test_generate_until_stops_at_the_stop_string(replica: ModelReplica, lm: DeepyLM) -> None:
    tok = LetterTokenizer()
    prompt = "the cat"
    free = run(replica, [tok.tokenize(prompt)], textgen_sampling(maximum_tokens=10))[0]
    text = tok.detokenize(free.tokens)
    stop = text[3] if text[3] != text[0] else text[4]
    (answer,) = lm.generate_until([request("generate_until", prompt, {"until": [stop], "max_gen_toks": 10})])
    assert answer == text[: text.index(stop)]
    (capped,) = lm.generate_until([request("generate_until", prompt, {"until": ["zzzz"], "max_gen_toks": 3})])
    assert capped == tok.detokenize(free.tokens[:3])
