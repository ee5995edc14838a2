"""Inception v4 on ImageNet: the original ``inception_v4.py`` command line, on estimax.

    python -m estimax.programs.inception_v4 --data_dir=DIR --model_dir=DIR [--use_data=real ...]

The original inception_v4.py was inception_v3.py with v4's network and these differences, which
are all this module holds: defaults ``--train_batch_size=256``, ``--train_steps=80000``,
``--learning_rate=0.15``, ``--use_annotated_bbox=True``, ``--learning_rate_decay_epochs=2``; and a
schedule that always warms up: ``--cold_learning_rate`` (0.001) for ``--cold_epochs`` (1), a
linear ramp over ``--warmup_epochs`` (2), then staircase decay
(``estimax.programs.schedules.inception_v4_schedule``). Everything else -- flags, loss, RMSProp,
moving average (used to evaluate and for ``--export_dir``), metrics, label handling -- is
``estimax.programs.inception_v3``'s. Every flag can also come from ``ESTIMAX_<FLAG>`` in the
environment, the command line winning.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from estimax.models import inception_v4 as inception_v4_model
from estimax.models.inception_v4 import InceptionV4
from estimax.programs import inception_v3, schedules

V4 = dataclasses.replace(
    inception_v3.V3,
    name="inception_v4",
    model=InceptionV4,
    defaults={
        "train_batch_size": 256,
        "train_steps": 80000,
        "learning_rate": 0.15,
        "use_annotated_bbox": True,
        "learning_rate_decay_epochs": 2,
    },
    schedule_flags=(
        ("cold_learning_rate", 0.001, "Learning rate of the first --cold_epochs."),
        ("cold_epochs", 1, "Epochs at --cold_learning_rate."),
        ("warmup_epochs", 2, "Epochs of linear warm-up after the cold ones."),
    ),
    schedule=schedules.inception_v4_schedule,
    doc=__doc__,
    tf_names=inception_v4_model.TF_NAMES,
)
FAMILY = inception_v3.family(V4)


def define_flags(fv: flags.FlagValues) -> None:
    """Defines the original inception_v4.py flags on ``fv``."""
    inception_v3.define_flags(fv, V4)


def run_from_flags(fv: flags.FlagValues):
    """Flags -> config -> Estimator -> the mode loop; returns the last eval results, if any."""
    return inception_v3.run_from_flags(fv, V4)


def run() -> None:
    """Console-script entry point (``inception_v4``)."""
    FAMILY.main()


if __name__ == "__main__":
    run()
