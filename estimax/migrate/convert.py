"""The documented path of the TF-checkpoint conversion, a command of ``estimax.tools``
(``estimax.tools.convert_tf``; ``estimax-convert tf-checkpoint`` runs it).

Kept so that code importing ``estimax.migrate.convert`` keeps working (the README's public API);
the import-layer contract (``.importlinter``) allows this one upward import by name.
"""

from estimax.tools.convert_tf import ProgramModel, convert_tf_checkpoint, program_model

__all__ = ["ProgramModel", "convert_tf_checkpoint", "program_model"]
