"""Compiling an Estimator's steps for a target that need not be here (a Cloud TPU slice, an
NVIDIA GPU) and what that reports (memory, flops, roofline). Above the estimator."""
