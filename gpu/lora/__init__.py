"""Batched LoRA math for the worker: which rows of a step use which adapter
(``batch``, pure numpy), and ``y += scaling * (x A^T) B^T`` over such a batch
(``ops``: a torch reference path for any device, Triton kernels on CUDA).

The LoRA feature (adapter loading, slots, the scheduler's adapter readiness) builds on
this contract; nothing here knows about adapters' files or names.
"""

__all__: list[str] = []
