"""Coming from TPUEstimator: read the original's TensorFlow checkpoints, map their names onto
estimax's models, convert them into estimax checkpoints and warm-start from them.

Nothing here imports TensorFlow (``savedmodel`` alone does, in the ``estimax[tf]`` venv).
"""

from estimax.migrate.tf_checkpoint import (
    CheckpointReader,
    TensorInfo,
    TFCheckpointError,
    list_variables,
    resolve_checkpoint,
)

__all__ = [
    "CheckpointReader",
    "TFCheckpointError",
    "TensorInfo",
    "list_variables",
    "resolve_checkpoint",
]
