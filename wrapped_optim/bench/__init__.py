"""Benchmarks: each module's ``run(quick)`` returns a Markdown section of measured numbers."""
