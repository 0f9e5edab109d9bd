"""megatron_rl.lora: low-rank adapters on the Megatron MoE policy (issue 54, in progress)."""
