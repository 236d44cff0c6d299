"""Batched LoRA for the worker: which rows of a step use which adapter (``batch``,
pure numpy), ``y += scaling * (x A^T) B^T`` over such a batch (``ops``: a torch
reference for any device, the CPU paths, Triton kernels on CUDA), the projections
adapters may target and their shapes (``targets``, no torch), the adapter slots'
weights (``pool``), a step's plan (``plan``) and the model's projections wrapped
(``layers``).

Nothing here reads adapter files or knows adapter names: the lora_loader actor does
(``actors/lora_loader``) and hands the weights over, slot by slot.
"""

__all__: list[str] = []
