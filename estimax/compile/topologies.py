"""The ``--compile_for`` targets' names, for the flag's help: this light module, not
``estimax.compile.compile`` (which imports the step builder and the export), is what every
program imports to define the flag, so a run that compiles nothing never imports the compiler."""

from __future__ import annotations

from estimax.compile import gpu_compile
from estimax.parallel.chips import TPU_CHIPS

# One single-host slice of each generation (libtpu takes any GEN:AxB[xC] it knows).
KNOWN_TOPOLOGIES = (
    "v2:2x2",
    "v3:2x2",
    "v4:2x2x1",
    "v5e:2x4",
    "v5p:2x2x1",
    "v6e:2x4",
    "tpu7x:2x2x1",  # libtpu's name for TPU7x (Ironwood): 4 chips, 8 TensorCores
)


def known_topologies() -> str:
    """The topology names to offer a user, as one phrase."""
    return (
        f"{', '.join(KNOWN_TOPOLOGIES)} (or any GEN:AxB[xC] slice of "
        f"{', '.join(TPU_CHIPS)} that libtpu knows), or GPUs: {gpu_compile.known_gpus()}"
    )
