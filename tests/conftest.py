"""Test set-up: eight virtual CPU devices, so replication is tested on one machine."""

import os

# Must happen before JAX initialises its backend (`make test` sets it too).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def bigtable_emulator():
    """A Cloud Bigtable emulator for the session, with BIGTABLE_EMULATOR_HOST set to it.

    Skips when cbtemulator is not installed (PATH, the Cloud SDK that gcloud reports,
    /usr/lib/google-cloud-sdk). Tests use their own table names: the emulator is shared.
    """
    pytest.importorskip("google.cloud.bigtable", reason="google-cloud-bigtable not installed")
    from estimax.tools import bigtable_emulator

    if bigtable_emulator.find_emulator() is None:
        pytest.skip("the Cloud Bigtable emulator (cbtemulator) is not installed: `gcloud "
                    "components install bigtable` or the google-cloud-cli-bigtable-emulator "
                    "package")
    with bigtable_emulator.running_emulator() as emulator:
        yield emulator
