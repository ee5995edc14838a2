"""State on disk: checkpoints (Orbax), the train state they hold, warm starts and variables.
Below the estimator; knows nothing of steps or meshes."""
