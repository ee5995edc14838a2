"""``Job``: everything the shared run needs, gathered by a program from its flags."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from absl import flags

from estimax.programs.configs import LoopConfig
from estimax.programs.family import Family


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything the shared tail needs, gathered by a program from its flags.

    Attributes:
      program: the program's name (kept in ``model_dir/flags.json``).
      model_flags: the flags that decide the checkpoint's shape, ``{name: value}``.
      model_fn, config, params: the Estimator's (built after the model_dir checks, so nothing
        is written into a model_dir that another trainer holds).
      batch_sizes: ``(train, eval)`` global batch sizes (predict uses eval's).
      input_fn: ``input_fn(is_training=...)`` -> the Estimator's input function.
      loop: mode, steps, export settings.
      serving: the features' spec for ``--export_dir``.
      preprocessing: for image programs, what the server applies to the JPEG/PNG bytes clients
        send (``estimax.export.resnet_eval(size)``...); None: clients send ``serving`` arrays.
      eval_preprocess: the input pipeline's eval preprocessing of one encoded image; with
        ``preprocessing`` declared as data, the export is checked to match it (no skew).
      check_inputs: returns a few examples (encoded images with ``preprocessing``, else an
        array of features) that the export is checked with against ``Estimator.predict``
        before it is published; None, or returning None: no check (fake data has no images).
      class_names: returns the export's class names by served id (``manifest_class_names``);
        None, or returning None: the export names no class.
      export_tolerance: ``(rtol, atol)`` for that check.
      metrics: the metrics printed for the last evaluation, and what its examples are called.
      notes: warnings to keep in TensorBoard's run description (fake data).
    """

    program: str
    model_flags: dict[str, Any]
    model_fn: Callable
    config: Any
    batch_sizes: tuple[int, int]
    input_fn: Callable[..., Callable]
    loop: LoopConfig
    serving: Any
    metrics: tuple[tuple[str, ...], str]
    params: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    preprocessing: Any = None
    eval_preprocess: Callable[[bytes], Any] | None = None
    check_inputs: Callable[[], Any] | None = None
    class_names: Callable[[], list[str] | None] | None = None
    export_tolerance: tuple[float, float] = (1e-3, 1e-4)
    # --warm_start_from: used only while model_dir has no checkpoint.
    warm_start_from: str | None = None
    # --compile_for: compile the steps for this TPU slice instead of running them.
    compile_for: str | None = None
    # (current --remat, model_fn under another --remat policy): what --compile_for tries when
    # the train step does not fit; None where the model has no --remat.
    remat: tuple[str, Callable[[str], Callable]] | None = None

    @classmethod
    def for_family(cls, family: Family, fv: flags.FlagValues, recipe: Any, **rest: Any) -> Job:
        """A job whose model, ``flags.json`` record, export and result line are ``family``'s.

        Args:
          family: the program's family.
          fv: the parsed flags.
          recipe: the family's config of these flags (``family.config_from_flags(fv)``, or a
            variant of it).
          **rest: the other fields (config, loop, input_fn, batch_sizes, ...).
        """
        return cls(
            program=family.name,
            model_flags=family.recorded_flags(fv),
            model_fn=family.make_model_fn(recipe),
            serving=family.input_spec(fv),
            preprocessing=family.preprocessing(fv),
            metrics=family.metrics,
            warm_start_from=fv["warm_start_from"].value if "warm_start_from" in fv else None,
            compile_for=fv["compile_for"].value if "compile_for" in fv else None,
            remat=_remat_variants(family, recipe),
            **rest,
        )


def _remat_variants(family: Family, recipe: Any) -> tuple[str, Callable[[str], Callable]] | None:
    """``Job.remat`` of a family's recipe that has a ``remat`` field (its --remat)."""
    if (
        not dataclasses.is_dataclass(recipe)
        or isinstance(recipe, type)
        or not hasattr(recipe, "remat")
    ):
        return None
    return recipe.remat, lambda policy: family.make_model_fn(
        dataclasses.replace(recipe, remat=policy)
    )
