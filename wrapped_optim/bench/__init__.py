"""Benchmarks: each module has ``run(quick) -> str`` (Markdown) and a ``__main__``."""
