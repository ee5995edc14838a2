"""Inception v4 on ImageNet: the original ``inception_v4.py`` command line, on estimax.

    python -m estimax.programs.inception_v4 --data_dir=DIR --model_dir=DIR [--use_data=real ...]

The original inception_v4.py was inception_v3.py with v4's network and these differences
(ORIGINAL_SYSTEM.md §6), which are all this module holds: defaults ``--train_batch_size=256``,
``--train_steps=80000``, ``--learning_rate=0.15``, ``--use_annotated_bbox=True``,
``--learning_rate_decay_epochs=2``; and a schedule that always warms up: ``--cold_learning_rate``
(0.001) for ``--cold_epochs`` (1), a linear ramp over ``--warmup_epochs`` (2), then staircase
decay (``estimax.estimator.schedules.inception_v4_schedule``). Everything else -- flags, loss,
RMSProp, moving average, metrics, label handling -- is ``estimax.programs.inception_v3``'s.
"""

from __future__ import annotations

import optax
from absl import app, flags

from estimax.estimator import schedules
from estimax.models.inception_v4 import InceptionV4
from estimax.programs import common, inception_v3


def _define_v4_schedule_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_float("cold_learning_rate", 0.001, "Learning rate of the first --cold_epochs.",
                       flag_values=fv)
    flags.DEFINE_integer("cold_epochs", 1, "Epochs at --cold_learning_rate.", flag_values=fv)
    flags.DEFINE_integer("warmup_epochs", 2, "Epochs of linear warm-up after the cold ones.",
                         flag_values=fv)


def _v4_schedule(fv: flags.FlagValues) -> optax.Schedule:
    return schedules.inception_v4_schedule(
        fv.learning_rate, fv.train_batch_size, learning_rate_decay=fv.learning_rate_decay,
        learning_rate_decay_epochs=fv.learning_rate_decay_epochs,
        cold_learning_rate=fv.cold_learning_rate, cold_epochs=fv.cold_epochs,
        warmup_epochs=fv.warmup_epochs)


V4 = inception_v3.Variant(
    name="inception_v4",
    model=InceptionV4,
    defaults={"train_batch_size": 256, "train_steps": 80000, "learning_rate": 0.15,
              "use_annotated_bbox": True, "learning_rate_decay_epochs": 2},
    define_schedule_flags=_define_v4_schedule_flags,
    schedule=_v4_schedule,
)


def define_flags(fv: flags.FlagValues) -> None:
    """Defines the original inception_v4.py flags on ``fv``."""
    inception_v3.define_flags(fv, V4)


def run_from_flags(fv: flags.FlagValues):
    """Flags -> config -> Estimator -> the mode loop; returns the last eval results, if any."""
    return inception_v3.run_from_flags(fv, V4)


def main(argv: list[str]) -> None:
    """The program: ``run_from_flags(flags.FLAGS)``."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    run_from_flags(flags.FLAGS)


def run() -> None:
    """Console-script entry point (``inception_v4``)."""
    define_flags(flags.FLAGS)
    # --help lists the flags this program defines through its helpers, too.
    flags.adopt_module_key_flags(inception_v3)
    flags.adopt_module_key_flags(common)
    app.run(main)


if __name__ == "__main__":
    run()
