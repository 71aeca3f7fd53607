"""A tiktoken encoder equivalent to a byte-level BPE ``tokenizers.Tokenizer``.

HF ``tokenizers`` and tiktoken run the same algorithm on byte-level BPE vocabularies (GPT-2 style:
``ByteLevel`` pre-tokenizer, ``BPE`` model, no normalizer), but tiktoken is about twice as fast on
this machine (see /work/shared/reference/ANCHORS.md). So for such a tokenizer we build a
``tiktoken.Encoding`` whose ranks *are* the HF ids:

* each vocabulary string is turned back into raw bytes (GPT-2's byte table);
* tiktoken merges the adjacent pair whose concatenation has the lowest rank, HF the pair with the
  earliest merge rule. These agree when merge results get increasing ids in merge order, which is how
  GPT-2 and every ``BpeTrainer`` vocabulary is laid out; we check it and give up otherwise;
* multi-byte entries that no merge produces are left out, since tiktoken could reach them and HF not;
* added tokens become tiktoken special tokens, split out of the text as HF does.

Anything this conversion cannot show to be equivalent returns None, and the caller keeps using HF.
After building, :func:`build_fast_encoder` compares ids with HF on a varied sample and also returns
None on any difference, so a wrong fast path can never be silently used.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tiktoken
import tokenizers

from megatron.tokenizer.byte_level import token_to_bytes

log = logging.getLogger(__name__)

# HF's ByteLevel regex (GPT-2's split), written with possessive quantifiers where that cannot change
# the match (nothing follows them in their branch) because fancy-regex then skips backtracking.
GPT2_SPLIT_PATTERN = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++"""
                      r"""|\s++$|\s+(?!\S)|\s""")

# Varied text for the equivalence check: contractions, digits, runs of spaces and newlines, tabs,
# accents, CJK, emoji, code, an added token inside text, trailing and leading whitespace.
VERIFY_SAMPLE: list[str] = [
    "Hello world! It's a test, isn't it? We'll see; they've said they'd come.",
    "  leading spaces and trailing   ",
    "\n\n\tdef f(x):\n        return x ** 2  # square\n\n\n",
    "Numbers 1234567890 and 3.14159, 1e-10, 0x1F; dates 2026-11-21.",
    "Café naïve résumé — “quotes” ‘single’ … ß ø Å",
    "日本語のテキストと中文文本，한국어 텍스트.",
    "emoji 🙂🚀👩‍💻 and symbols ©®™ ≤≥ ∑∫ √",
    "<|endoftext|>after the end<|endoftext|><|padding|> more",
    "UPPER lower MiXeD snake_case camelCase kebab-case path/to/file.py",
    "a" * 300 + " " + "ab" * 200,
    "   \n   \n",
    " ",
    "",
    "'s 're 've 'm 'll 'd 'S 'RE",
    "x = {'a': [1, 2, 3], \"b\": (4, 5)}\r\nprint(x)\r\n",
]


class FastBPE:
    """Encodes with tiktoken; ids equal HF's for the tokenizer it was built from."""

    def __init__(self, encoding: tiktoken.Encoding, split_special: bool) -> None:
        self.encoding = encoding
        # HF splits added tokens out of the text; GPT-2's original encoder does not.
        specials = sorted(encoding.special_tokens_set) if split_special else []
        self._specials = specials
        # Special-aware encoding costs ~10% more, so texts that contain no special string (nearly
        # all) take encode_ordinary; a substring test is far cheaper than the difference.
        self._special_re = re.compile("|".join(map(re.escape, specials))) if len(specials) > 4 else None

    def _has_special(self, text: str) -> bool:
        if self._special_re is not None:
            return self._special_re.search(text) is not None
        return any(s in text for s in self._specials)

    def encode(self, text: str) -> list[int]:
        if self._specials and self._has_special(text):
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        if num_threads <= 1 or len(texts) < 2:
            return [self.encode(t) for t in texts]
        # tiktoken's encode releases the GIL, so threads encode in parallel.
        with ThreadPoolExecutor(num_threads) as pool:
            return list(pool.map(self.encode, texts, chunksize=max(1, len(texts) // (4 * num_threads))))


def _split_pattern(pre: dict[str, Any] | None) -> str | None:
    """The split regex of a byte-level pre-tokenizer, or None if it is not one we can mirror."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_SPLIT_PATTERN
    if pre.get("type") == "Sequence":
        # e.g. [Split(regex, Isolated), ByteLevel(use_regex=False)] as in newer vocabularies.
        parts = pre.get("pretokenizers", [])
        if (len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"
                and not parts[1].get("use_regex", True) and not parts[1].get("add_prefix_space")
                and parts[0].get("behavior") == "Isolated" and not parts[0].get("invert")
                and "Regex" in parts[0].get("pattern", {})):
            return str(parts[0]["pattern"]["Regex"])
    return None


def _encoding_from_json(spec: dict[str, Any], name: str) -> tiktoken.Encoding | None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    if spec.get("normalizer") is not None or spec.get("truncation") or spec.get("padding"):
        return None
    post = spec.get("post_processor")
    if post is not None and post.get("type") != "ByteLevel":
        return None  # a template would add BOS/EOS tokens that tiktoken does not
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return None

    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    special = {t["content"]: int(t["id"]) for t in added}

    vocab: dict[str, int] = model["vocab"]
    merges = model.get("merges") or []
    results: list[str] = []
    for m in merges:
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        results.append(left + right)

    # Merge results must get increasing ids in merge order (rank order == merge priority).
    reachable: set[str] = set()
    last_id = -1
    for tok in results:
        if tok in reachable:
            continue  # a later rule that makes the same token never fires first
        tid = vocab.get(tok)
        if tid is None or tid <= last_id:
            return None
        last_id = tid
        reachable.add(tok)

    ranks: dict[bytes, int] = {}
    for tok, tid in vocab.items():
        if tok in special:
            continue
        raw = token_to_bytes(tok)
        if raw is None:
            return None
        if len(raw) == 1 or tok in reachable:
            ranks[raw] = int(tid)
    if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
        return None  # tiktoken needs every single byte to be a token
    if set(special.values()) & set(ranks.values()):
        return None
    try:
        enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    except Exception as err:  # tiktoken rejects the table (duplicate ids, bad regex): keep HF
        log.info("fast BPE path unavailable: %s", err)
        return None
    return enc


def build_fast_encoder(hf: tokenizers.Tokenizer, name: str = "deepy-bpe",
                       split_special: bool = True, sample: list[str] | None = None) -> FastBPE | None:
    """A tiktoken encoder giving the same ids as ``hf``, or None if it cannot be shown to."""
    try:
        spec = json.loads(hf.to_str())
    except Exception:  # pragma: no cover - any tokenizer serializes
        return None
    encoding = _encoding_from_json(spec, name)
    if encoding is None:
        return None
    fast = FastBPE(encoding, split_special=split_special)
    texts = VERIFY_SAMPLE + (sample or [])
    if not verify(fast, hf, texts):
        log.warning("fast BPE path disagrees with HF tokenizers on the sample; using HF")
        return None
    return fast


def verify(fast: FastBPE, hf: tokenizers.Tokenizer, texts: list[str]) -> bool:
    """True when the fast encoder reproduces HF's ids on every text."""
    expected = [e.ids for e in hf.encode_batch(texts)]
    return [fast.encode(t) for t in texts] == expected
