"""State on disk: checkpoints (Orbax), the train state they hold, warm starts, variables, and
the writer lock of a model_dir. Below the estimator; knows nothing of steps or meshes."""
