"""generate.py and eval.py end to end through deepy.py, on a tiny model trained here.

One training run (dp2, pipeline model, ZeRO-1) serves every test; each test launches one real
multi-rank run at another layout (tp2, pp2 load through a universal checkpoint) and checks what it
wrote against references computed independently in this process: the trained weights loaded into a
single-process `GPTModel`, and the same network as `transformers`' `GPTNeoXForCausalLM`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from generation_fixtures import TRAIN_LAYOUT, deepy, hf_model, output, reference_model, train

from megatron.model import lm_loss
from megatron.tokenizer.char_level import CharLevelTokenizer

pytestmark = pytest.mark.slow

EOD = 0
SEQ = 64
MAX_TOKENS = 24
PROMPTS = ["the cat sees", "a dog", "my friend reads the", "the teacher takes a"]
TP2 = ("num_gpus=2", "model_parallel_size=2", "pipe_parallel_size=1", "zero_optimization={stage: 1}")
PP2 = ("num_gpus=2", "model_parallel_size=1", "pipe_parallel_size=2", "zero_optimization={stage: 1}")
TOK = CharLevelTokenizer()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("generate")
    train(tmp)
    return tmp


@pytest.fixture(scope="module")
def model(run_dir: Path) -> Any:
    return reference_model(run_dir / "ckpt" / "global_step60")


@pytest.fixture(scope="module")
def completions(run_dir: Path) -> list[dict[str, Any]]:
    """input-file at the training layout (dp2: two prompts per replica), KV cache, logits kept."""
    (run_dir / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    proc = deepy(run_dir, "generate.py", *TRAIN_LAYOUT, "text_gen_type=input-file", "sample_input_file=prompts.txt",
                 f"maximum_tokens={MAX_TOKENS}", "sample_output_file=completions.jsonl", "return_logits=true")
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "--- sample 4/4" in proc.stdout
    return [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]


def hf_greedy(hf: Any, prompt: list[int], use_cache: bool) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, use_cache=use_cache, eos_token_id=EOD,
                      pad_token_id=EOD)
    tokens = out[0, ids.shape[1] :].tolist()
    return tokens[: tokens.index(EOD)] if EOD in tokens else tokens


def test_input_file_greedy_equals_transformers_generate(completions: list[dict[str, Any]], model: Any) -> None:
    hf = hf_model(model)
    ids = torch.tensor([TOK.tokenize(PROMPTS[0])])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4  # the two are one network
    assert [row["prompt"] for row in completions] == PROMPTS
    for row in completions:
        assert row["tokens"] and row["text"] == TOK.detokenize(row["tokens"]) and row["length"] == len(row["tokens"])
        for use_cache in (True, False):
            assert hf_greedy(hf, TOK.tokenize(row["prompt"]), use_cache) == row["tokens"], (row, use_cache)
        # return_logits: the logits before each token, whose argmax greedy decoding took
        assert [int(np.argmax(step)) for step in row["logits"]] == row["tokens"]


def test_unconditional_on_tp2_without_cache_equals_the_cached_greedy(run_dir: Path, model: Any) -> None:
    proc = deepy(run_dir, "generate.py", *TP2, "text_gen_type=unconditional", "num_samples=2", "recompute=true",
                 f"maximum_tokens={MAX_TOKENS}", "sample_output_file=unconditional.jsonl", "return_logits=true")
    assert proc.returncode == 0, output(proc)[-4000:]
    # the dp2 checkpoint is read by the weights-only reader and cut for tp2, not by a training engine
    assert "generate.py: weights of" in output(proc) and "through the training engine" not in output(proc)
    rows = [json.loads(line) for line in (run_dir / "unconditional.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["tokens"] == rows[1]["tokens"]  # greedy: both samples agree
    hf = hf_model(model)
    expected = hf_greedy(hf, [EOD], use_cache=True)  # an empty prompt starts at EOD
    assert rows[0]["tokens"] == expected and rows[0]["finished"] == (len(expected) < MAX_TOKENS)
    with torch.no_grad():  # the logits before each generated token, against transformers' forward
        hf_logits = hf(torch.tensor([[EOD] + expected])).logits[0, : len(expected), : TOK.vocab_size]
    assert torch.allclose(torch.tensor(rows[0]["logits"]), hf_logits, atol=1e-4)
    assert rows[0]["prompt"] == "" and "--- sample 2/2" in proc.stdout and rows[0]["text"] in proc.stdout


def test_interactive_on_two_pipeline_stages(run_dir: Path, completions: list[dict[str, Any]]) -> None:
    proc = deepy(run_dir, "generate.py", *PP2, "text_gen_type=interactive", f"maximum_tokens={MAX_TOKENS}",
                 stdin=f"{PROMPTS[0]}\n\n{PROMPTS[3]}\n")
    assert proc.returncode == 0, output(proc)[-4000:]
    shown = [line for line in proc.stdout.splitlines() if line.startswith("prompt> ")]
    # one line per prompt read (the empty one is skipped), the completion after it, then EOF
    completed = [line.removeprefix("prompt> ").removeprefix("prompt> ") for line in shown if line.strip() != "prompt>"]
    assert completed == [completions[0]["text"], completions[3]["text"]], proc.stdout[-3000:]


def windowed_reference(model: Any, tokens: list[int]) -> np.ndarray:
    """The precompute format, computed directly: log_softmax of a full forward per window."""
    values = [0.0]
    for start in range(0, len(tokens) - 1, SEQ):
        window = tokens[start : start + SEQ + 1]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([window[:-1]]))[0].float(), -1)
        values.extend(logp.gather(-1, torch.tensor(window[1:]).unsqueeze(-1))[:, 0].tolist())
    return np.asarray(values[: len(tokens)], dtype=np.float32)


def test_precompute_on_tp2_writes_reference_logprobs(run_dir: Path, model: Any) -> None:
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.reference_logprobs import open_reference_logprobs

    proc = deepy(run_dir, "generate.py", *TP2, "text_gen_type=precompute", "precompute_model_name=ref")
    assert proc.returncode == 0, output(proc)[-4000:]
    prefix = str(run_dir / "data" / "corpus_text_document")
    ref = open_reference_logprobs(prefix, "ref", SEQ)  # float32, aligned with every document, scored at SEQ
    assert json.loads((run_dir / "data" / "corpus_text_document_ref.json").read_text()) == {"seq_length": SEQ}
    tokens = MMapIndexedDataset(prefix)
    long_docs = [i for i in range(len(tokens)) if len(tokens[i]) > SEQ + 1]
    assert long_docs  # the window rule is exercised
    for i in list(range(0, len(tokens), 25)) + long_docs[:3]:
        assert np.allclose(ref[i], windowed_reference(model, tokens[i].astype(np.int64).tolist()), atol=1e-4), i


TASK_DOCS = [
    {"context": "the cat sees", "continuation": " the book.", "text": "the cat sees the book. a dog likes an apple."},
    {"context": "a dog", "continuation": " likes", "text": "my friend reads the old map."},
    {"context": "", "continuation": "the bird", "text": "the teacher takes a blue cup. the cat finds the small house. "
                                                        "a child wants the book."},
]


def write_tasks(tmp: Path) -> list[str]:
    tasks = tmp / "tasks"
    tasks.mkdir(exist_ok=True)
    data = tasks / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in TASK_DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    specs = {
        "ll": "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
              "metric_list:\n  - metric: acc\n  - metric: perplexity\n",
        "roll": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        "gen": "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
               "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\nmetric_list:\n  - metric: exact_match\n",
    }
    for name, body in specs.items():
        (tasks / f"{name}.yaml").write_text(f"task: deepy_{name}\n{common}{body}")
    return [f"tasks/{name}.yaml" for name in specs]


def loss_sum(model: Any, tokens: list[int], first_target: int) -> float:
    """Minus the training loss summed over targets tokens[first_target:]."""
    labels = torch.tensor([tokens[1:]])
    labels[0, : first_target - 1] = -100
    with torch.no_grad():
        mean = lm_loss(model(torch.tensor([tokens[:-1]])), labels)
    return -float(mean) * (len(tokens) - first_target)


def test_eval_on_local_tasks_matches_the_model_loss(run_dir: Path, model: Any) -> None:
    tasks = write_tasks(run_dir)
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(run_dir / "hf_cache")}
    proc = deepy(run_dir, "eval.py", *TRAIN_LAYOUT, f"eval_tasks=[{', '.join(tasks)}]", "eval_results_prefix=eval/run",
                 env=offline)  # fmt: skip
    assert proc.returncode == 0, output(proc)[-4000:]
    results = json.loads((run_dir / "eval" / "run_eval_results.json").read_text())
    assert set(results["results"]) == {"deepy_ll", "deepy_roll", "deepy_gen"}
    assert results["deepy"]["iteration"] == 60

    def samples(task: str) -> list[dict[str, Any]]:
        rows = [json.loads(line) for line in (run_dir / "eval" / f"run_eval_samples_{task}.jsonl").read_text().splitlines()]
        return sorted(rows, key=lambda r: r["doc_id"])

    for row, doc in zip(samples("deepy_ll"), TASK_DOCS):
        context = TOK.tokenize(doc["context"]) or [EOD]
        tokens = context + TOK.tokenize(doc["continuation"])
        assert abs(row["resps"][0][0][0] - loss_sum(model, tokens, len(context))) < 1e-3, row
    for row, doc in zip(samples("deepy_roll"), TASK_DOCS):
        tokens = [EOD] + TOK.tokenize(doc["text"])
        total, done = 0.0, 0
        while done < len(tokens) - 1:  # windows of SEQ predictions, each with all the context that fits
            end = min(done + SEQ, len(tokens) - 1)
            window = tokens[max(0, end - SEQ) : end + 1]
            total += loss_sum(model, window, len(window) - (end - done))
            done = end
        assert abs(row["resps"][0][0] - total) < 1e-3, row
    for row, doc in zip(samples("deepy_gen"), TASK_DOCS):
        expected = TOK.detokenize(hf_greedy(hf_model(model), TOK.tokenize(doc["context"]) or [EOD], True)[:12])
        assert row["resps"][0][0] == expected.split(".")[0], row

    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in metrics if "lm_eval/deepy_ll/acc" in r)
    assert row["iteration"] == 60
    assert row["lm_eval/deepy_roll/bits_per_byte"] == pytest.approx(results["results"]["deepy_roll"]["bits_per_byte,none"])
