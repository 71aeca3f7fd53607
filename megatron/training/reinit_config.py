"""The keys of the token re-initialisation (``reinit_tokens.py``), apart from it so the launcher reads them without
torch. Levanter's ``sft.py`` rule (``reinit_tokens``, ``reinit_lm_head``, ``reinit_embeddings``; the dialect maps them,
``neox_arguments/dialects/levanter_sft.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from pydantic import Field

from megatron.config_rules import RuleContext, rule
from megatron.config_schema import ArgGroup
from megatron.errors import ConfigError
from megatron.tokenizer.build import build_tokenizer, tokenizer_class
from megatron.tokenizer.config import TokenizerArgs

if TYPE_CHECKING:
    from megatron.tokenizer.base import Tokenizer


class ReinitTokensArgs(ArgGroup):
    """Deepy's own group (not in GPT-NeoX's ``NeoXArgs``): re-drawing some tokens' rows of the embedding and output
    matrices when a run starts (Levanter's ``sft.py``)."""

    reinit_tokens: list[str] | None = Field(None, min_length=1)
    """Tokens (as the tokenizer spells them, e.g. `<|eot_id|>`) whose rows of the token embedding and of the output
    layer are re-drawn when the run starts at step 0, after the weights it starts from are loaded (never on a
    resume): each row = truncated normal in [-3, 3] * std + mean, the mean and population std per hidden unit over
    the tokenizer's rows of that matrix (Levanter's sft.py). Tied weights: the one matrix is re-drawn once.
    None: nothing is re-drawn."""

    reinit_lm_head: bool = True
    """With reinit_tokens: re-draw the tokens' rows of the output layer (untied weights)."""

    reinit_embeddings: bool = True
    """With reinit_tokens: re-draw the tokens' rows of the token embedding."""

    def redrawn(self, tied: bool) -> tuple[bool, bool]:
        """Whether the (token embedding, output layer) rows are re-drawn. Tied weights are one matrix, the embedding,
        re-drawn once when either setting asks (Levanter's tied models have no head of their own)."""
        if not self.reinit_tokens:
            return False, False
        if tied:
            return self.reinit_embeddings or self.reinit_lm_head, False
        return self.reinit_embeddings, self.reinit_lm_head


def looks_tokens_up(tokenizer_type: str) -> bool | None:
    """Whether the ``tokenizer_type`` plug-in has a token table to look ``reinit_tokens`` up in (a Hugging Face
    tokenizer); None for a name no plug-in has (the tokenizer's own rule names it)."""
    kind = tokenizer_class(tokenizer_type)
    if kind is None:
        return None
    from megatron.tokenizer.hf import HFBackedTokenizer  # lazy: the tokenizers library, not read by every config

    return isinstance(kind, type) and issubclass(kind, HFBackedTokenizer)


def token_ids(tokenizer: Tokenizer, tokens: Sequence[str]) -> list[int]:
    """The ids of ``tokens`` as the tokenizer spells them; a token it does not have is a ConfigError (sft.py:320-329
    raises 'One or more tokens are not in the tokenizer vocabulary'). Before launch (``reinit_tokens_runs``) and on
    the ranks (``reinit_tokens.py``) alike."""
    from megatron.tokenizer.hf import HFBackedTokenizer  # lazy: the tokenizers library, not read by every config

    if not isinstance(tokenizer, HFBackedTokenizer):
        raise ConfigError(f"reinit_tokens looks tokens up in a Hugging Face tokenizer (HFTokenizer, HFGPT2Tokenizer, "
                          f"GPT2BPETokenizer); {tokenizer.name} has no token table to look them up in")
    found = {token: tokenizer.hf_tokenizer.token_to_id(token) for token in tokens}
    missing = [token for token, tid in found.items() if tid is None]
    if missing:
        raise ConfigError(f"reinit_tokens: {', '.join(map(repr, missing))} not in the tokenizer's vocabulary; list "
                          f"tokens as the tokenizer spells them")
    return [int(found[token]) for token in tokens]  # type: ignore[arg-type]  # None ruled out above


def _tokens_in_the_tokenizer(ctx: RuleContext, tokens: list[str]) -> list[str]:
    """The tokenizer the ranks build has each token (built here from the same keys, as ``tokenizer_loads`` does)."""
    kind = str(ctx.get("tokenizer_type"))
    table = looks_tokens_up(kind)
    if table is None:
        return []
    if not table:
        return [f"{ctx.show('reinit_tokens')} looks the tokens up in a Hugging Face tokenizer's token table "
                f"(HFTokenizer, HFGPT2Tokenizer, GPT2BPETokenizer), but {ctx.show('tokenizer_type')} has none: use "
                f"one of those tokenizers, or remove reinit_tokens"]
    try:
        tokenizer = build_tokenizer(cast(TokenizerArgs, ctx.args))
    except Exception:  # noqa: BLE001 - tokenizer_loads reports a tokenizer that cannot be built (or seen) here
        return []
    try:
        token_ids(tokenizer, tokens)
    except ConfigError as err:
        return [f"{ctx.show('reinit_tokens')} with {ctx.show('vocab_file')}: {err.message}"]
    return []


@rule
def reinit_tokens_runs(ctx: RuleContext) -> list[str]:
    """What the re-drawing needs: a token list without repeats, a matrix to re-draw, weights that are trained and
    saved (not a LoRA run's frozen base) and the language-model objective (a reference copy or value head would not
    see the new rows). Any ZeRO stage: under stage 3 each matrix is gathered whole for the draw."""
    tokens = ctx.get("reinit_tokens")
    if not tokens:
        return [f"{ctx.show(key)} is read only with reinit_tokens; set reinit_tokens or leave it out"
                for key in ("reinit_lm_head", "reinit_embeddings") if ctx.given(key)]
    problems = []
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        problems.append(f"{ctx.show('reinit_tokens')} names {', '.join(repeated)} more than once; list each token once")
    if not ctx.get("reinit_lm_head") and not ctx.get("reinit_embeddings"):
        problems.append(f"{ctx.show('reinit_tokens')} with {ctx.show('reinit_lm_head')} and "
                        f"{ctx.show('reinit_embeddings')} re-draws nothing; enable one or drop reinit_tokens")
    if int(ctx.get("lora_r") or 0) > 0:
        problems.append(f"{ctx.show('reinit_tokens')} with {ctx.show('lora_r')}: the embeddings are the frozen base "
                        "of a LoRA run; re-drawing them is not built (Levanter's lora_lm.py has no reinit_tokens)")
    if str(ctx.get("train_impl")) != "normal":
        problems.append(f"{ctx.show('reinit_tokens')} with {ctx.show('train_impl')}: built for language-model "
                        "training (train_impl: normal, Levanter's sft.py); a reference copy or value head would not "
                        "see the re-drawn rows")
    return problems + _tokens_in_the_tokenizer(ctx, tokens)
