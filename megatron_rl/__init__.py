"""megatron_rl: reinforcement-learning post-training of mixture-of-experts LLMs on Megatron-core."""

__version__ = "0.1.0"
