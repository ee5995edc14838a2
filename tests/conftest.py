"""Test set-up: eight virtual CPU devices, so replication is tested on one machine."""

import os

# Must happen before JAX initialises its backend (`make test` sets it too).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
