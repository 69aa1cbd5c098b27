"""Benchmarks: each module has run(quick) -> Markdown; python -m wrapped_optim.bench.<topic>."""
