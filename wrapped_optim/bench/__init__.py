"""Benchmarks: one module per topic, assembled into docs/benchmarks.md by ``wrapped-optim bench``.

Each topic module ``wrapped_optim.bench.<topic>`` exposes ``run(quick: bool = False) -> str``
returning a Markdown section (measured numbers and how to reproduce them) and may expose
``plots(out_dir: Path) -> list[Path]`` writing PNG figures (matplotlib, the ``plots`` extra).
``python -m wrapped_optim.bench.<topic>`` prints one topic's section;
:mod:`wrapped_optim.bench.report` runs them all. The CUDA checks are test code:
``python -m tests.gpu.gpu_all`` runs them from a source checkout.
"""
