"""The documented path of the SavedModel writer, an export format of ``estimax.serving``
(``estimax.serving.savedmodel``; ``estimax export-savedmodel`` runs it). ::

    python -m estimax.migrate.savedmodel --export_dir=serving/3 --output_dir=savedmodel/3

Kept so that this command and ``import estimax.migrate.savedmodel`` keep working (the README's
public API); the import-layer contract (``.importlinter``) allows this one upward import by name.
"""

import sys

from estimax.serving.savedmodel import SavedModelCheckError, export_savedmodel, main

__all__ = ["SavedModelCheckError", "export_savedmodel", "main"]

if __name__ == "__main__":
    sys.exit(main())
