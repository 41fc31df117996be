"""Keeping the global batch size when the world size changes.

An elastic job that loses or gains ranks changes how many samples one optimizer step sees, unless
each rank accumulates gradients over more (or fewer) micro-batches. :func:`accumulation_steps`
says how many, or refuses clearly when the numbers cannot add up. Nothing else has to change: the
data position is global (:class:`~crashproof.ResumableSampler` counts the samples the whole job
received), so a step of the resumed run takes exactly the samples the same step would have taken
on the old world size, in the same order (only how they are split between ranks differs).
"""

from __future__ import annotations

import torch

from crashproof.errors import ConfigError

__all__ = ["accumulation_steps"]


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int | None = None) -> int:
    """Micro-batches each rank accumulates per optimizer step so that one step sees
    ``global_batch`` samples: ``global_batch / (micro_batch * world_size)``.

    ``world_size`` defaults to ``torch.distributed``'s (1 when it is not initialised). Raises
    :class:`ConfigError` when ``global_batch`` is not a multiple of ``micro_batch * world_size``.
    """
    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if global_batch < 1 or micro_batch < 1 or world_size < 1:
        raise ConfigError(
            f"accumulation_steps({global_batch}, {micro_batch}, world_size={world_size}): "
            "all must be positive"
        )
    per_step = micro_batch * world_size
    if global_batch % per_step:
        fits = [
            w
            for w in range(1, global_batch // micro_batch + 1)
            if global_batch % (micro_batch * w) == 0
        ]
        raise ConfigError(
            f"a global batch of {global_batch} cannot be split into micro-batches of {micro_batch} "
            f"on {world_size} ranks ({global_batch} is not a multiple of {per_step}); world sizes "
            f"that fit: {fits}, or change the micro-batch size"
        )
    return global_batch // per_step
