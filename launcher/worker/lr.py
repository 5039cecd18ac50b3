"""Learning-rate scaling by the share of replicas that contributed gradients."""

from __future__ import annotations

import math

from ft_launch.config import LrScaling


def lr_factor(policy: LrScaling, contributors: int, replicas: int) -> float:
    """Multiplier of the base learning rate for a step averaged over ``contributors``
    of ``replicas`` configured replicas. FT-HSDP: sqrt smooths the loss in failures."""
    if replicas < 1 or not 0 <= contributors <= replicas:
        raise ValueError(f"contributors={contributors} must be within 0..replicas={replicas}")
    share = contributors / replicas
    if policy is LrScaling.LINEAR:
        return share
    if policy is LrScaling.SQRT:
        return math.sqrt(share)
    return 1.0
