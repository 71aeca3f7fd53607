"""Our tokenizer as Hugging Face tokenizer files, written only when it encodes exactly like ours.

Each tokenizer type gets a candidate HF tokenizer:

* ``HFTokenizer`` / ``HFGPT2Tokenizer`` / ``GPT2BPETokenizer``: the ``tokenizers`` object we already run;
* ``CharLevelTokenizer``: a byte-level BPE with no merges, token id = byte value (id 0 = end of document);
* ``TiktokenTokenizer`` (a local ranks file): transformers' ``TikTokenConverter`` with our split pattern;
* ``SPMTokenizer``: transformers' SentencePiece conversion (Llama's).

The candidate is then run on a fixed sample of texts (scripts, digits, whitespace runs, emoji) and
must produce our ids exactly; otherwise the export stops and names the first text that differs.
That check is what makes "the exported model speaks the same token ids" a fact rather than a hope.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizerObject, decoders, models, pre_tokenizers

from megatron import plugins
from megatron.errors import ConversionError, DeepyError
from megatron.interop.hf_config import SpecialTokens
from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.build import build_tokenizer
from megatron.tokenizer.byte_level import byte_to_char
from megatron.tokenizer.config import TokenizerArgs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SAMPLE_TEXTS: tuple[str, ...] = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(12345))",
    "  leading spaces, trailing spaces   \t tabs\r\nwindows line",
    "Grüße aus Köln – naïve café, 東京タワー, Ελληνικά, русский, עברית, 🙂🚀",
    "numbers 3.14159 2,718 1e-9 -42 0x1F and punctuation ?!;:'\"()[]{}",
    "",
)
"""Texts the exported tokenizer must encode exactly like ours (no special-token literals: GPT-2's
original encoder reads them as plain text, as ours does)."""


@dataclass(frozen=True)
class TokenizerFiles:
    """The tokenizer keys of a config (``tokenizer_type``, ``vocab_file``, ``merge_file``)."""

    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None


def build_tokenizer_from_files(files: TokenizerFiles) -> Tokenizer:
    """Our tokenizer for these keys, through the same registry training uses."""
    if plugins.find("tokenizer_type", files.tokenizer_type) is None:
        raise ConversionError(f"tokenizer_type {files.tokenizer_type!r} is unknown; choose one of "
                              f"{', '.join(plugins.names('tokenizer_type'))}")
    for path in (files.vocab_file, files.merge_file):
        if path and files.tokenizer_type != "TiktokenTokenizer" and not os.path.exists(path):
            raise ConversionError(
                f"tokenizer file {path} (from the checkpoint's config) not found; pass --vocab-file / --merge-file "
                "with its current location"
            )
    try:
        # the registry's tokenizers are built from the tokenizer's keys, typed as their group
        return build_tokenizer(TokenizerArgs(tokenizer_type=files.tokenizer_type, vocab_file=files.vocab_file,
                                             merge_file=files.merge_file))
    except DeepyError:
        raise
    except Exception as err:  # noqa: BLE001 - a tokenizer library's own error for a bad file
        raise ConversionError(f"cannot build the {files.tokenizer_type} tokenizer: {err}") from None


def _char_level() -> Any:
    """Bytes as tokens: id = byte value, as ``CharLevelTokenizer`` (a BPE with no merges over the byte alphabet)."""
    vocab = {char: byte for byte, char in byte_to_char().items()}
    hf = HFTokenizerObject(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf


def _tiktoken(files: TokenizerFiles) -> Any:
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # lazy: tiktoken is optional (TiktokenTokenizer only)
    from megatron.tokenizer.fast_bpe import GPT2_SPLIT_PATTERN
    from megatron.tokenizer.tiktoken_tokenizer import EOD

    if not files.vocab_file or not os.path.isfile(files.vocab_file):
        raise ConversionError(
            f"TiktokenTokenizer {files.vocab_file!r}: exporting needs a local .tiktoken ranks file as vocab_file "
            "(a named encoding has no file to convert)"
        )
    converter = TikTokenConverter(vocab_file=files.vocab_file, pattern=GPT2_SPLIT_PATTERN, extra_special_tokens=[EOD])
    return converter.converted()


def _candidate(files: TokenizerFiles, ours: Tokenizer) -> "PreTrainedTokenizerBase":
    # lazy: transformers (seconds to import), only for Hugging Face conversions
    from transformers import PreTrainedTokenizerFast

    kind = files.tokenizer_type
    if kind == "SPMTokenizer":
        # lazy: transformers (seconds to import), only for Hugging Face conversions
        from transformers import LlamaTokenizer

        assert files.vocab_file is not None
        try:
            native = LlamaTokenizer.convert_to_native_format(vocab_file=files.vocab_file)
            return LlamaTokenizer(**native, add_bos_token=False, add_eos_token=False)
        except Exception as err:  # noqa: BLE001 - transformers' converter raises many types
            raise ConversionError(f"SentencePiece model {files.vocab_file} has no HF equivalent: {err}") from None
    if kind == "CharLevelTokenizer":
        backend = _char_level()
    elif kind == "TiktokenTokenizer":
        backend = _tiktoken(files)
    elif hasattr(ours, "hf_tokenizer"):
        backend = ours.hf_tokenizer
    else:
        raise ConversionError(f"tokenizer_type {kind}: exporting this tokenizer is not supported")
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _token(hf: "PreTrainedTokenizerBase", token_id: int) -> str | None:
    token = hf.convert_ids_to_tokens(token_id)
    return token if isinstance(token, str) else None


def check_same_ids(hf: "PreTrainedTokenizerBase", ours: Tokenizer, texts: tuple[str, ...] = SAMPLE_TEXTS) -> None:
    for text in texts:
        expected = list(ours.tokenize(text))
        got = list(hf(text, add_special_tokens=False)["input_ids"])
        if got != expected:
            raise ConversionError(
                f"the Hugging Face tokenizer built for {type(ours).__name__} encodes {text[:60]!r} differently "
                f"(first ids: ours {expected[:12]}, HF {got[:12]}); not writing a tokenizer that would feed the model "
                "other ids (use --no-tokenizer to export the model alone)"
            )


def export_tokenizer(files: TokenizerFiles, out_dir: Path, model_max_length: int) -> SpecialTokens:
    """Write HF tokenizer files for ``files`` into ``out_dir``; return the ids the model config names."""
    ours = build_tokenizer_from_files(files)
    hf = _candidate(files, ours)
    eod = _token(hf, ours.eod)
    pad = _token(hf, ours.pad)
    special: dict[str, Any] = {}
    if eod is not None:
        special.update(eos_token=eod, bos_token=eod)
    if pad is not None:
        special["pad_token"] = pad
    hf.add_special_tokens(special)
    check_same_ids(hf, ours)
    hf.model_max_length = model_max_length
    hf.save_pretrained(out_dir)
    return SpecialTokens(bos=ours.eod, eos=ours.eod, pad=ours.pad)


def special_tokens_of(files: TokenizerFiles) -> SpecialTokens:
    ours = build_tokenizer_from_files(files)
    return SpecialTokens(bos=ours.eod, eos=ours.eod, pad=ours.pad)


# --- import --------------------------------------------------------------------------------------
def _is_byte_tokenizer(path: Path) -> bool:
    """Whether a tokenizer.json is the byte tokenizer ``CharLevelTokenizer`` exports (id = byte value)."""
    try:
        model = json.loads(path.read_text(encoding="utf-8")).get("model", {})
    except (OSError, ValueError):
        return False
    expected = {char: byte for byte, char in byte_to_char().items()}
    return model.get("type") == "BPE" and not model.get("merges") and model.get("vocab") == expected


def import_tokenizer(hf_dir: Path, out_dir: Path) -> TokenizerFiles | None:
    """Copy an HF model directory's tokenizer into ``out_dir`` as files our tokenizers read."""
    if (hf_dir / "tokenizer.json").is_file() and _is_byte_tokenizer(hf_dir / "tokenizer.json"):
        return TokenizerFiles("CharLevelTokenizer")
    if (hf_dir / "tokenizer.json").is_file():
        target = out_dir / "tokenizer.json"
        shutil.copyfile(hf_dir / "tokenizer.json", target)
        return TokenizerFiles("HFTokenizer", str(target.resolve()))
    if (hf_dir / "tokenizer.model").is_file():
        target = out_dir / "tokenizer.model"
        shutil.copyfile(hf_dir / "tokenizer.model", target)
        return TokenizerFiles("SPMTokenizer", str(target.resolve()))
    return None
