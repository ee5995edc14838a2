"""Where a run's arrays and processes lie: layouts (spatial, FSDP), the mesh, the chips, and the
many-host modules (distributed start, launch, pre-flight, watchdog). Below the estimator and the
models; knows nothing of a ``model_fn``."""
