"""One :class:`~megatron.neox_arguments.schema.ArgGroup` subclass per GPT-NeoX argument group."""
