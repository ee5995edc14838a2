"""A model family: what estimax knows of one program's model, written once, in the program's file.

Every place that used to switch on a program's name (the TF-checkpoint conversion, warm starts,
the converter's ``--model`` choices, ``flags.json``) looks a ``Family`` up instead
(``estimax.programs.families``). Adding a family takes its model file (with its TensorFlow name
map if it has a TF original), its program file (which ends with its ``FAMILY``) and one line in
the registry.

| who                     | reads from the family                                            |
|-------------------------|------------------------------------------------------------------|
| its console script      | ``main``: flags, ``--help`` text, ``run_from_flags``             |
| ``common.run``          | ``name``, ``recorded_flags`` (``flags.json``), ``input_spec``,   |
|                         | ``serving_preprocessing``, ``metrics``                           |
| ``estimax-convert``     | ``parse``, ``config_from_flags``, ``make_model_fn``,             |
| ``tf-checkpoint``       | ``example_features``, ``recorded_flags``, ``tf_names``           |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import flags

__all__ = ["Family"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family (a program of the original and its network).

    Attributes:
      name: the program's name: its console script, ``model_dir/flags.json``'s ``program``,
        ``estimax-convert tf-checkpoint --model=NAME``.
      doc: the program's module docstring (its ``--help``).
      define_flags: defines the program's flags on a ``FlagValues``.
      config_from_flags: parsed flags -> the recipe (network and hyperparameters).
      make_model_fn: the recipe -> ``model_fn(features, labels, mode, params)``.
      model_flags: the flags that decide the checkpoint's shape: recorded in
        ``model_dir/flags.json`` by a training run and compared by every later run.
      input_spec: parsed flags -> the spec of one batch of features (``TensorSpec((None, ...),
        dtype)``): what the input feeds the model_fn and what an export takes.
      serving_preprocessing: parsed flags -> what the server applies to the encoded images
        clients send (``estimax.export.resnet_eval(size)``...); None: clients send arrays.
      run_from_flags: parsed flags -> runs the program; returns the last eval results.
      metrics: the metrics of the result line and what its examples are called.
      tf_names: the TensorFlow original's names (``estimax.models.TF_NAMES``); None without one.
      config_keys: the original's params keys its ``--config_file``/``--params_override`` take
        (``estimax.programs.config_file``); None: the program has no such flags.
    """

    name: str
    doc: str
    define_flags: Callable[[flags.FlagValues], None]
    config_from_flags: Callable[[flags.FlagValues], Any]
    make_model_fn: Callable[[Any], Callable]
    model_flags: tuple[str, ...]
    input_spec: Callable[[flags.FlagValues], Any]
    run_from_flags: Callable[[flags.FlagValues], Any]
    metrics: tuple[tuple[str, ...], str]
    serving_preprocessing: Callable[[flags.FlagValues], Any] | None = None
    tf_names: Any = None
    config_keys: Mapping[str, Any] | None = None

    def recorded_flags(self, fv: flags.FlagValues) -> dict[str, Any]:
        """``{flag: value}`` of the model-shaping flags (``model_dir/flags.json``)."""
        return {name: fv[name].value for name in self.model_flags}

    def example_features(self, fv: flags.FlagValues, batch_size: int = 1) -> np.ndarray:
        """Zeros of the features' shape and dtype: what a state is initialised (or compiled) on."""
        spec = self.input_spec(fv)
        return np.zeros((batch_size, *spec.shape[1:]), spec.dtype)

    def preprocessing(self, fv: flags.FlagValues) -> Any:
        """The serving preprocessing for these flags (None: clients send arrays)."""
        return None if self.serving_preprocessing is None else self.serving_preprocessing(fv)

    def parse(self, argv: Sequence[str]) -> flags.FlagValues:
        """A fresh registry with the program's flags, parsed from ``argv`` (``--name=value``...).

        Raises:
          absl's ``flags.Error``: an unknown flag or a bad value.
        """
        fv = flags.FlagValues()
        self.define_flags(fv)
        fv([self.name, *argv])
        return fv

    def main(self) -> None:
        """The program's console-script entry point."""
        from estimax.programs import cli

        config = None if self.config_keys is None else (self.name, self.config_keys)
        cli.main(self.define_flags, self.run_from_flags, self.doc, config)
