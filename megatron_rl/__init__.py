"""megatron_rl: reinforcement-learning post-training of mixture-of-experts LLMs on Megatron-core.

megatron-core imports wandb at import time (an optional logger that nothing here uses through
megatron) and that costs about a second; wandb is registered as a lazy module instead, so its
code runs only when a run logs to wandb (`megatron_rl.train.run_logger`).
"""

from megatron_rl.lazy_exports import lazy_module

__version__ = "0.1.0"

lazy_module("wandb")
