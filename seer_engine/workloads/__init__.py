"""Rollout workloads: real response traces, a synthetic generator fitted to them, their
statistics, and trace replay. Import from the submodules (``traces``, ``synthetic``,
``stats``, ``replay``...); this package sits above ``rollout/`` and below ``sim/``."""
