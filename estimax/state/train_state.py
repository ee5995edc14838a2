"""``TrainState``: what a train step carries and a checkpoint holds (besides the input position)."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


@struct.dataclass
class TrainState:
    """Everything a checkpoint holds besides the input position."""

    step: jax.Array
    params: Any
    model_state: Any  # mutable collections other than params, e.g. batch_stats
    opt_state: Any
    ema_params: Any  # {} when the spec asks for no EMA
