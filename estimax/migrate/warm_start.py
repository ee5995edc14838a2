"""The documented path of warm starts, which are the estimator's: ``estimax.estimator.warm_start``.

Kept so that code importing ``estimax.migrate.warm_start`` keeps working (the README's public
API); the import-layer contract (``.importlinter``) allows this one upward import by name.
"""

from estimax.estimator.warm_start import WarmStartReport, WarmStartSettings, warm_start

__all__ = ["WarmStartReport", "WarmStartSettings", "warm_start"]
