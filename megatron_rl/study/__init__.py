"""Comparison studies of RL arms over seeds: statistics (`stats`) used by tools/compare_runs.py."""
