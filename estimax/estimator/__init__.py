"""The Estimator contract and its loops; knows nothing of images."""
