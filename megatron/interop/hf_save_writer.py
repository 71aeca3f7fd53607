"""The writer of the Hugging Face model directories a training run saves (``hf_save_path``,
``megatron/training/hf_saves.py``), made of the exporter's pieces: the architecture and config
(``hf_config``), the tensors (``hf_weights``), ``save_pretrained`` (``hf_model``), the tokenizer
(``hf_tokenizer``) and, for a LoRA run, the adapters merged as ``convert_neox_to_hf.py --adapters merge``
merges them (``megatron.model.lora.merge_adapters``). ``train.py`` hands it to ``pretrain``; training does
not import this package.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron.errors import ConversionError
from megatron.interop.hf_config import choose_architecture, hf_config_from_gpt
from megatron.interop.hf_model import save_hf_model
from megatron.interop.hf_tokenizer import TokenizerFiles, export_tokenizer
from megatron.interop.hf_weights import to_hf_state_dict
from megatron.interop.lora_export import fused_sections
from megatron.model.config import GPTConfig
from megatron.model.lora import merge_adapters
from megatron.tokenizer.config import TokenizerArgs


class HFModelWriter:
    """Writes ``config``'s model, holding the weights it is given, as a ``transformers`` model directory in
    ``dtype``, with the tokenizer's files. Built before training: a model without a ``transformers`` class or a
    tokenizer that cannot be written is refused then (``ConversionError``), not at the first save."""

    def __init__(self, config: GPTConfig, tokenizer: TokenizerArgs, dtype: torch.dtype,
                 lora_scale: float | None) -> None:
        self.config, self.dtype, self.lora_scale = config, dtype, lora_scale
        try:
            self.architecture = choose_architecture(config)
            files = TokenizerFiles(tokenizer.tokenizer_type, tokenizer.vocab_file, tokenizer.merge_file)
            with tempfile.TemporaryDirectory() as tmp:  # written once, copied into every save
                tokens = export_tokenizer(files, Path(tmp), config.max_positions)
                self.tokenizer_files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
            self.hf_config = hf_config_from_gpt(config, tokens, dtype)
        except ConversionError as err:
            raise ConversionError(f"hf_save_path (HF saves while training) cannot write this run: {err}") from None

    def __call__(self, weights: Mapping[str, torch.Tensor], out_dir: Path) -> None:
        full = dict(weights)
        if self.lora_scale is not None:
            full = merge_adapters(full, self.lora_scale, fused_sections(self.config))  # split adapters too
        save_hf_model(self.hf_config, to_hf_state_dict(self.config, self.architecture, full), out_dir, self.dtype)
        for name, data in self.tokenizer_files.items():
            (out_dir / name).write_bytes(data)
