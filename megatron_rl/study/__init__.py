"""Comparison studies of RL arms over seeds (``megatron-rl study``, megatron_rl/cli/study.py):
the grid of arms (`grid`), their runs (`jobs`), statistics (`stats`), summaries and records."""
