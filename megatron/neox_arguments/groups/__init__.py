"""One :class:`~megatron.config_schema.ArgGroup` subclass per GPT-NeoX argument group."""
