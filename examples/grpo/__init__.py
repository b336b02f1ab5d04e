"""The parts of ``examples/grpo_loop.py``: settings, server client, trainer, checkpoints."""
