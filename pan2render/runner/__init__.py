"""The runner: Ray driver, GPU worker groups, staged jobs, resume and the ``pan2-render`` CLI.

Import graph: ``runner`` -> ``jobs`` (specs, ledger), ``media`` (mp4), ``models`` (only inside the
worker). The driver reaches workers only through ``groups.Executor``.
"""
