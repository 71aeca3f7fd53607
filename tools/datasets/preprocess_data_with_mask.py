#!/usr/bin/env python
"""Tokenize post-training jsonl (SFT, preference pairs, KTO rewards) into aligned MMIDIDX datasets.

Every document gets tokens and a parallel label sequence: the token id where the loss applies and -100
where it does not (prompts, user and system turns, template markup). Outputs for ``--output-prefix P``:

- ``--mode sft``:      ``P_text_document``, ``P_label_document``
- ``--mode pairwise``: ``P_chosen_document``, ``P_chosen_label_document``, ``P_rejected_document``,
  ``P_rejected_label_document`` (document k of each is pair k; for DPO and reward models)
- ``--mode reward``:   the SFT pair plus ``P_reward_document`` (one float32 per document; for KTO)

A record is either prompt/completion strings (``--prompt-key``/``--completion-key``; for pairwise the
``--chosen-key``/``--rejected-key`` completions share the prompt) or a chat: a list of
``{"role", "content"}`` messages under ``--messages-key`` (or as the chosen/rejected values) rendered with
the tokenizer's chat template, a jinja2 string from ``--chat-template FILE`` or the ``chat_template`` of
the ``tokenizer_config.json`` next to ``--vocab-file``. Only assistant turns get loss: the template is
rendered for growing prefixes of the conversation, and the text an assistant turn adds is the only
text whose tokens keep their labels.

``--single-turn`` reads a chat the way Levanter's ``sft.py`` does (``dataset_type: chat_jsonl``): the first
message of ``--input-role`` is the prompt and the first of ``--output-role`` the completion, joined with
nothing between them (no chat template), encoded with the tokenizer's special tokens (a BOS its
post-processor adds), the end-of-text token appended when the tokenizer does not end ``"hi there"`` with it,
truncated to ``--max-length``; every token after the prompt's (the completion and that end token) is
trained on (stanford-crfm/levanter 9263f81e: ``data/text.py:812-843``, ``main/sft.py:363-404``,
``data/packing.py:142-143``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from megatron.data.url_sources import open_text
from megatron.errors import DataError, run_guarded
from megatron import plugins
from megatron.tokenizer import Tokenizer, build_tokenizer
from megatron.tokenizer.config import TokenizerArgs

IGNORE_INDEX = -100
Encoded = tuple[list[int], list[int]]  # (token ids, labels)


# ---- chat templates ---------------------------------------------------------------------------
class ChatTemplate:
    """A HF-style jinja2 chat template, rendered in a sandbox."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise DataError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as err:
            raise DataError(f"chat template does not parse: {err}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # tokenizer_config.json may store {"content": "<s>", ...}
        return str(value.get("content", ""))
    return str(value or "")


def load_chat_template(template_file: str | None, vocab_file: str | None) -> ChatTemplate | None:
    """``--chat-template FILE`` wins; else ``chat_template`` from tokenizer_config.json beside the vocab."""
    config: dict[str, Any] = {}
    if vocab_file:
        cfg_path = Path(vocab_file).parent / "tokenizer_config.json"
        if cfg_path.is_file():
            config = json.loads(cfg_path.read_text())
    source: str | None
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise DataError(f"--chat-template {path}: file not found")
        source = path.read_text()
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


# ---- encoding ---------------------------------------------------------------------------------
def _segments_to_ids(tokenizer: Tokenizer, segments: list[tuple[str, bool]]) -> Encoded:
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in segments:
        if not text:
            continue
        piece = tokenizer.tokenize(text)
        ids.extend(piece)
        labels.extend(piece if trained else [IGNORE_INDEX] * len(piece))
    return ids, labels


def _finish(tokenizer: Tokenizer, encoded: Encoded, append_eod: bool) -> Encoded:
    ids, labels = encoded
    if append_eod:  # the model must learn to stop, so the EOD after a completion gets loss
        ids = ids + [tokenizer.eod]
        labels = labels + [tokenizer.eod if any(x != IGNORE_INDEX for x in labels) else IGNORE_INDEX]
    return ids, labels


def encode_prompt_completion(tokenizer: Tokenizer, prompt: str, completion: str, append_eod: bool) -> Encoded:
    """Prompt tokens get no loss; completion tokens do."""
    return _finish(tokenizer, _segments_to_ids(tokenizer, [(prompt, False), (completion, True)]), append_eod)


def encode_messages(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]],
                    append_eod: bool) -> Encoded:
    """Render the chat; only the text each assistant turn adds is trained on."""
    full = template.render(messages)
    segments: list[tuple[str, bool]] = []
    done = 0
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = template.render(messages[:k], add_generation_prompt=True)
        through = template.render(messages[: k + 1])
        if not (full.startswith(before) and full.startswith(through) and done <= len(before) <= len(through)):
            raise DataError("the chat template does not render conversations incrementally (a prefix of the "
                            "messages must render to a prefix of the text); assistant-only loss needs that")
        segments += [(full[done : len(before)], False), (full[len(before) : len(through)], True)]
        done = len(through)
    segments.append((full[done:], False))
    return _finish(tokenizer, _segments_to_ids(tokenizer, segments), append_eod)


@dataclass(frozen=True)
class SingleTurn:
    """Levanter's single-turn chat reading (sft.py's ``chat_jsonl``): which roles, how long a sequence."""

    input_role: str = "user"
    output_role: str = "assistant"
    max_length: int | None = None


def _eos_text(tokenizer: Tokenizer, vocab_file: str | None) -> tuple[str, int]:
    """The end-of-text token (text, id): ``eos_token`` of the tokenizer_config.json beside the vocab (what
    transformers' tokenizer calls eos), else the tokenizer's end-of-document token."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is None:
        raise DataError("--single-turn encodes with a Hugging Face tokenizer (--tokenizer-type HFTokenizer)")
    config_path = Path(vocab_file).parent / "tokenizer_config.json" if vocab_file else None
    if config_path is not None and config_path.is_file():
        text = _token_text(json.loads(config_path.read_text()).get("eos_token"))
        if text and hf.token_to_id(text) is not None:
            return text, int(hf.token_to_id(text))
    return str(hf.id_to_token(tokenizer.eod)), tokenizer.eod


def encode_single_turn(tokenizer: Tokenizer, messages: list[dict[str, Any]], turn: SingleTurn, eos: tuple[str, int],
                       where: str) -> Encoded | None:
    """One conversation as Levanter's sft.py trains on it, or None where sft.py skips it (a prompt of
    ``max_length - 1`` tokens or more, or no completion token left after truncation)."""
    hf = tokenizer.hf_tokenizer  # type: ignore[attr-defined]
    try:
        source = next(str(m["content"]) for m in messages if m.get("role") == turn.input_role)
        target = next(str(m["content"]) for m in messages if m.get("role") == turn.output_role)
    except StopIteration:
        raise DataError(f"{where}: no message with role {turn.input_role!r} and one with role "
                        f"{turn.output_role!r}") from None
    eos_text, eos_id = eos
    if hf.encode("hi there").ids[-1] != eos_id:  # text.py:857-858: EOS only where the tokenizer adds none
        target += eos_text
    limit = turn.max_length
    source_ids = hf.encode(source).ids[:limit]
    ids = hf.encode(source + target).ids[:limit]
    prompt = len(source_ids)
    if (limit is not None and prompt > limit - 1) or len(ids) <= prompt:  # sft.py:386-394
        return None
    return ids, [IGNORE_INDEX] * prompt + ids[prompt:]


@dataclass
class Options:
    mode: str
    prompt_key: str
    completion_key: str
    messages_key: str
    chosen_key: str
    rejected_key: str
    reward_key: str
    append_eod: bool
    single_turn: SingleTurn | None = None
    eos: tuple[str, int] = ("", -1)


def _check_messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise DataError(f"{where}: messages must be a list of {{'role', 'content'}} objects")
    return value


def _encode_one(record: dict[str, Any], value: Any, tokenizer: Tokenizer, template: ChatTemplate | None,
                opts: Options, where: str) -> Encoded:
    """``value`` is a completion string (prompt from the record) or a list of chat messages."""
    if isinstance(value, list):
        if template is None:
            raise DataError(f"{where}: chat messages need a chat template: pass --chat-template FILE or use a "
                            "tokenizer whose tokenizer_config.json has chat_template")
        return encode_messages(tokenizer, template, _check_messages(value, where), opts.append_eod)
    prompt = record.get(opts.prompt_key, "")
    if not isinstance(value, str) or not isinstance(prompt, str):
        raise DataError(f"{where}: {opts.prompt_key!r} and the completion must be strings")
    return encode_prompt_completion(tokenizer, prompt, value, opts.append_eod)


def _get(record: dict[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise DataError(f"{where}: missing key {key!r} (keys present: {', '.join(sorted(record))})")
    return record[key]


def encode_record(record: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate | None, opts: Options,
                  where: str) -> dict[str, Any]:
    """Output role -> (ids, labels), plus ``reward`` (float) in reward mode."""
    out: dict[str, Any] = {}
    if opts.mode == "pairwise":
        for role, key in (("chosen", opts.chosen_key), ("rejected", opts.rejected_key)):
            out[role] = _encode_one(record, _get(record, key, where), tokenizer, template, opts, where)
        return out
    if opts.single_turn is not None:
        encoded = encode_single_turn(tokenizer, _check_messages(_get(record, opts.messages_key, where), where),
                                     opts.single_turn, opts.eos, where)
        out["text"] = encoded if encoded is not None else ([], [])
    elif opts.messages_key in record:
        out["text"] = _encode_one(record, record[opts.messages_key], tokenizer, template, opts, where)
    else:
        out["text"] = _encode_one(record, _get(record, opts.completion_key, where), tokenizer, template, opts, where)
    if opts.mode == "reward":
        raw = _get(record, opts.reward_key, where)
        if isinstance(raw, bool):  # KTO's desirable/undesirable flag
            out["reward"] = 1.0 if raw else -1.0
        elif isinstance(raw, (int, float)):
            out["reward"] = float(raw)
        else:
            raise DataError(f"{where}: {opts.reward_key!r} must be a number or true/false, got {raw!r}")
    return out


def iter_records(paths: list[str]) -> Iterator[tuple[dict[str, Any], str]]:
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: input file not found")
        with open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: malformed JSON ({err.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{where}: each line must be a JSON object")
                yield record, where


# ---- writing ----------------------------------------------------------------------------------
class _Writers:
    """One builder per output dataset; all finalized together, or all aborted."""

    def __init__(self, prefix: str, roles: list[str], vocab_size: int, with_reward: bool) -> None:
        self.builders: dict[str, tuple[MMapIndexedDatasetBuilder, str]] = {}
        for role in roles:
            self._add(f"{role}", f"{prefix}_{role}_document", best_fitting_dtype(vocab_size))
            label_name = "label" if role == "text" else f"{role}_label"
            # Labels hold -100, so they need a signed dtype.
            self._add(label_name, f"{prefix}_{label_name}_document", np.int32)
        if with_reward:
            self._add("reward", f"{prefix}_reward_document", np.float32)

    def _add(self, name: str, out_prefix: str, dtype: Any) -> None:
        self.builders[name] = (MMapIndexedDatasetBuilder(out_prefix + ".bin", dtype), out_prefix)

    def write(self, name: str, values: list[int] | list[float]) -> None:
        builder = self.builders[name][0]
        builder.add_item(np.asarray(values, dtype=builder.dtype))
        builder.end_document()

    def finalize(self) -> list[str]:
        for builder, prefix in self.builders.values():
            builder.finalize(prefix + ".idx")
        return [prefix for _, prefix in self.builders.values()]

    def abort(self) -> None:
        for builder, _ in self.builders.values():
            builder.abort()


def preprocess_with_mask(paths: list[str], output_prefix: str, tokenizer: Tokenizer,
                         template: ChatTemplate | None, opts: Options) -> dict[str, Any]:
    """Encode every record and write the aligned datasets; returns counts and the written prefixes."""
    roles = ["chosen", "rejected"] if opts.mode == "pairwise" else ["text"]
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    writers = _Writers(output_prefix, roles, tokenizer.vocab_size, opts.mode == "reward")
    docs = skipped = 0
    try:
        for record, where in iter_records(paths):
            encoded = encode_record(record, tokenizer, template, opts, where)
            if any(len(encoded[r][0]) == 0 for r in roles):
                skipped += 1  # an empty side would be an unusable sample
                continue
            for role in roles:
                ids, labels = encoded[role]
                writers.write(role, ids)
                writers.write("label" if role == "text" else f"{role}_label", labels)
            if "reward" in encoded:
                writers.write("reward", [encoded["reward"]])
            docs += 1
        if docs == 0:
            raise DataError(f"no usable documents in {', '.join(paths)}")
        written = writers.finalize()
    except BaseException:
        writers.abort()
        raise
    return {"documents": docs, "skipped_empty": skipped, "outputs": written}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="comma-separated jsonl files (.jsonl, .jsonl.gz, .jsonl.zst)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--mode", choices=["sft", "pairwise", "reward"], default="sft")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--completion-key", default="completion")
    p.add_argument("--messages-key", default="messages")
    p.add_argument("--chosen-key", default="chosen")
    p.add_argument("--rejected-key", default="rejected")
    p.add_argument("--reward-key", default="reward")
    p.add_argument("--chat-template", default=None, help="file with a jinja2 chat template")
    p.add_argument("--tokenizer-type", required=True, choices=sorted(plugins.names("tokenizer_type")))
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--append-eod", action="store_true", help="end each document with EOD (trained after a completion)")
    p.add_argument("--single-turn", action="store_true",
                   help="Levanter sft.py's chat_jsonl: first input-role message + first output-role message, no template")
    p.add_argument("--input-role", default="user", help="with --single-turn: the prompt's role")
    p.add_argument("--output-role", default="assistant", help="with --single-turn: the completion's role")
    p.add_argument("--max-length", type=int, default=None, help="with --single-turn: tokens kept per conversation")
    p.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = build_tokenizer(TokenizerArgs(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                                              merge_file=args.merge_file))
    template = load_chat_template(args.chat_template, args.vocab_file)
    single = SingleTurn(args.input_role, args.output_role, args.max_length) if args.single_turn else None
    if single is not None and args.mode != "sft":
        raise DataError("--single-turn writes an SFT dataset (--mode sft)")
    opts = Options(args.mode, args.prompt_key, args.completion_key, args.messages_key, args.chosen_key,
                   args.rejected_key, args.reward_key, args.append_eod, single,
                   _eos_text(tokenizer, args.vocab_file) if single is not None else ("", -1))
    paths = [s.strip() for s in args.input.split(",") if s.strip()]
    stats = preprocess_with_mask(paths, args.output_prefix, tokenizer, template, opts)
    print(f"{stats['documents']} documents ({stats['skipped_empty']} skipped: empty, or too long for --single-turn) -> "
          + ", ".join(stats["outputs"]))
    return 0


def cli() -> None:
    """The ``deepy-preprocess-data-with-mask`` console script: clean one-line errors, exit code 2."""
    run_guarded(main)


if __name__ == "__main__":
    cli()
