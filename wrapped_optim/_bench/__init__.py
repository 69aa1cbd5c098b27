"""Benchmarks: one module per topic, assembled into docs/benchmarks.md by ``wrapped-optim bench``.

Each topic module ``wrapped_optim._bench.<topic>`` measures with ``collect(quick) -> dict`` (its
rows, kept as JSON beside its page) and makes from the rows its Markdown section
(``render(data)``), its one-sentence result (``headline(data)``) and its PNG figures
(``plots(data, image_dir)``, matplotlib: the ``plots`` extra); ``run(quick)`` returns
``render(collect(quick))``.
``python -m wrapped_optim._bench.<topic>`` prints one topic's section;
:mod:`wrapped_optim._bench.report` runs them all. The CUDA checks are test code:
``python -m tests.gpu.gpu_all`` runs them from a source checkout.
"""
