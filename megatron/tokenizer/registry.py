"""Deepy's tokenizers as plug-ins: each ``tokenizer_type`` a registry entry with what it needs.

Declared here by name and needs, in a module that imports no tokenizer (nor its library), so ``deepy.py``
validates a config (and the docs list the accepted values) without them; ``build.py`` attaches the classes,
imported by name when a tokenizer is built. A user's tokenizer (``plugins:``) registers whole in one file,
with :func:`megatron.plugins.register` on its :class:`~megatron.tokenizer.base.Tokenizer` subclass, and may
declare its own keys (``keys=``) and checks (``check=``) like any plug-in.

``needs`` of a tokenizer:

* ``requires`` — the file keys it cannot be built without (``vocab_file``, ``merge_file``): unset,
  the build names them instead of failing inside the tokenizer library (a plug-in's own keys have
  their defaults and ranges in its ``keys``, and its ``check``);
* ``package`` — ``(module, pip package)`` of an optional library it needs, checked before launch
  (``megatron/neox_arguments/optional_packages.py``).

The names are GPT-NeoX's ``tokenizer_type`` values, in GPT-NeoX's spelling.
"""

from __future__ import annotations

from megatron import plugins

plugins.declare("tokenizer_type", "GPT2BPETokenizer", module=__name__, requires=("vocab_file", "merge_file"))
plugins.declare("tokenizer_type", "HFTokenizer", module=__name__, requires=("vocab_file",))
# vocab_file too, but HFGPT2Tokenizer explains what it reads (a local tokenizer.json or vocab.json;
# GPT-NeoX would download GPT-2's) when it is missing
plugins.declare("tokenizer_type", "HFGPT2Tokenizer", module=__name__)
plugins.declare("tokenizer_type", "SPMTokenizer", module=__name__, requires=("vocab_file",),
                package=("sentencepiece", "sentencepiece"))
plugins.declare("tokenizer_type", "CharLevelTokenizer", module=__name__)
plugins.declare("tokenizer_type", "TiktokenTokenizer", module=__name__, requires=("vocab_file",),
                package=("tiktoken", "tiktoken"))
plugins.builtins_declared("tokenizer_type")
