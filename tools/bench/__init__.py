"""Benchmarks that print figures and ratios side by side in one run (see docs/benchmarks.md)."""
