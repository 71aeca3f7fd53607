"""``build_tokenizer(config)``: the ``tokenizer_type`` plug-in the config names, built from its keys.

Deepy's tokenizers get their classes here, by name (``"module:class"``, imported when one is built): each
imports its library (``tokenizers``, ``sentencepiece``, ``tiktoken``) at its top, and only the one a config
names must be installed.
"""

from __future__ import annotations

import logging

from megatron import plugins
from megatron.errors import ConfigError
from megatron.tokenizer.base import Tokenizer
from megatron.tokenizer.config import TokenizerArgs

log = logging.getLogger(__name__)

for _name, _target in {
    "GPT2BPETokenizer": "megatron.tokenizer.hf:GPT2BPETokenizer",
    "HFTokenizer": "megatron.tokenizer.hf:HFTokenizer",
    "HFGPT2Tokenizer": "megatron.tokenizer.hf:HFGPT2Tokenizer",
    "SPMTokenizer": "megatron.tokenizer.spm:SPMTokenizer",
    "CharLevelTokenizer": "megatron.tokenizer.char_level:CharLevelTokenizer",
    "TiktokenTokenizer": "megatron.tokenizer.tiktoken_tokenizer:TiktokenTokenizer",
}.items():
    plugins.attach("tokenizer_type", _name, target=_target)


def build_tokenizer(config: TokenizerArgs) -> Tokenizer:
    """The tokenizer ``config.tokenizer_type`` names (a registered plug-in, ``registry.py``), reading
    ``config.vocab_file``/``merge_file`` and, for a plug-in declaring keys, its own keys: ``config`` is
    the arguments object (a bare ``TokenizerArgs`` for tools that have no config file)."""
    plugin = plugins.find("tokenizer_type", config.tokenizer_type)
    if plugin is None:
        raise ConfigError(f"tokenizer_type: unknown value {config.tokenizer_type!r}; choose one of "
                          f"{', '.join(plugins.names('tokenizer_type'))}")
    if plugin.keys is not None and not isinstance(config, plugin.keys):
        raise ConfigError(f"tokenizer_type={config.tokenizer_type} reads its own keys ({plugin.keys.__name__}): "
                          "build it from the arguments object (NeoXArgs), which holds them")
    given = {"vocab_file": config.vocab_file, "merge_file": config.merge_file}
    for key in plugin.needs.get("requires", ()):
        if not given[key]:
            raise ConfigError(f"tokenizer_type={config.tokenizer_type} needs {key}: set it to the tokenizer's file")
    tokenizer = plugin.resolve().from_config(config)
    log.info("tokenizer %s (%s backend): vocab %d", config.tokenizer_type, tokenizer.backend, tokenizer.vocab_size)
    return tokenizer


def tokenizer_class(tokenizer_type: str) -> type[Tokenizer] | None:
    """The class of the ``tokenizer_type`` plug-in (Deepy's imported now, with its library), or None for a name
    no plug-in has."""
    plugin = plugins.find("tokenizer_type", tokenizer_type)
    return None if plugin is None else plugin.resolve()
