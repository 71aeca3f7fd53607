"""Checkpoint tools: convert to and from Hugging Face, inspect a checkpoint."""
