"""A pipeline rank's model chunks under interleaved pipeline parallelism (virtual stages).

With ``--virtual-pipeline-model-parallel-size V`` each pipeline rank ``r`` of ``PP`` holds ``V``
megatron `GPTModel` chunks; chunk ``c`` is virtual stage ``c * PP + r`` and holds the layers
`megatron_rl.model.stages.virtual_chunk_layers` gives it (global layer numbers, so each chunk's
HF names follow from its own ``decoder.layers[i].layer_number``). Only chunk 0 of rank 0 embeds
and only chunk ``V - 1`` of the last rank has the output layer.

`ModelChunks` holds them as one module, so that one megatron DDP (its grad buffers span every
chunk), one optimizer, the offload and the checkpoints see one rank's parameters as before;
megatron's interleaved schedule runs the chunks themselves (`as_chunks`), and the torch_dist
checkpoint asks each chunk for its sharded state (its keys are then any other layout's). Without
interleaving a rank's model is the `GPTModel` itself and `as_chunks` returns it alone.
"""

from __future__ import annotations

import torch


class ModelChunks(torch.nn.Module):
    """``V`` `GPTModel` chunks of one pipeline rank, in chunk order (``chunks.{c}.`` names)."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        super().__init__()
        if len(chunks) < 2:
            raise ValueError(f"ModelChunks needs >= 2 chunks, got {len(chunks)}")
        self.chunks = torch.nn.ModuleList(chunks)
        self.config = chunks[0].config

    # megatron's finalize_model_grads finds the tied embedding through these (first / last stage)
    @property
    def pre_process(self) -> bool:
        return self.chunks[0].pre_process

    @property
    def post_process(self) -> bool:
        return self.chunks[-1].post_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.chunks[0].share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The embedding (chunk 0 of the first rank) or the output weight (last chunk)."""
        holder = self.chunks[0] if self.pre_process else self.chunks[-1]
        return holder.shared_embedding_or_output_weight()

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "ModelChunks is not called: megatron's interleaved schedule runs each chunk "
            "(megatron_rl.train.pipeline); use as_chunks(model)"
        )


def as_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The megatron `GPTModel` chunks of ``model`` (DDP-wrapped or not), in chunk order: one
    without interleaving."""
    module = getattr(model, "module", model)
    if isinstance(module, ModelChunks):
        return list(module.chunks)
    return [module]
