"""Moving models between Deepy and other formats: Hugging Face ``transformers`` and GPT-NeoX checkpoints.

Everything here works on *full* (unsharded) weights under our canonical parameter names
(``layers.3.attention.query_key_value.weight``, the names ``GPTModel`` uses in one process):

* ``deepy_checkpoint``: full weights from a Deepy checkpoint at any tp/pp/ZeRO layout, and a
  weights-only Deepy checkpoint written at a chosen tp/pp;
* ``hf_config`` / ``hf_weights``: the architecture and the tensors in ``transformers``' terms
  (GPTNeoXForCausalLM, LlamaForCausalLM, MistralForCausalLM), both ways, refusing what has no
  faithful equivalent;
* ``convert``: the converters' work; a GPT-NeoX checkpoint is read by ``megatron.checkpointing.neox``
  (``reader.py``), the package that owns GPT-NeoX's format;
* ``hf_tokenizer``: our tokenizer as HF tokenizer files, checked to encode identically;
* ``verify``: our model and the ``transformers`` model on one batch, max |Δ logits|;
* ``yaml_config``: the Deepy config written next to an imported checkpoint.

It lives outside ``megatron/checkpointing`` on purpose: that package is what a training run
imports to save and resume through the DeepSpeed engine; conversion is offline work that pulls
in ``transformers`` and never runs inside a training rank. The command-line tools are
``tools/ckpts/convert_neox_to_hf.py`` and ``tools/ckpts/convert_hf_to_neox.py``.
"""
