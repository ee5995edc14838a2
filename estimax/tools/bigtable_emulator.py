"""The Cloud Bigtable emulator (``cbtemulator`` of the Google Cloud SDK) for tests and trials.

    python -m estimax.tools.bigtable_emulator [--port=8086]   # prints BIGTABLE_EMULATOR_HOST=...

``gcloud beta emulators bigtable start`` does the same when the gcloud component is set up; this
finds the binary itself (``PATH``, then the SDK root that ``gcloud info`` reports, then the Debian
package's ``/usr/lib/google-cloud-sdk``), starts it on a free localhost port and waits until the
port accepts connections. The emulator keeps its tables in memory: they are gone when it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

__all__ = ["Emulator", "find_emulator", "running_emulator"]

_BINARY = "cbtemulator"
_SDK_SUBDIR = os.path.join("platform", "bigtable-emulator")
_DEBIAN_SDK_ROOT = "/usr/lib/google-cloud-sdk"


def find_emulator() -> str | None:
    """The path of ``cbtemulator``, or None if neither PATH nor a Cloud SDK has it."""
    found = shutil.which(_BINARY)
    if found:
        return found
    roots = []
    gcloud = shutil.which("gcloud")
    if gcloud:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [gcloud, "info", "--format=value(installation.sdk_root)"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if out.returncode == 0 and out.stdout.strip():
                roots.append(out.stdout.strip())
    roots.append(_DEBIAN_SDK_ROOT)
    for root in roots:
        path = os.path.join(root, _SDK_SUBDIR, _BINARY)
        if os.access(path, os.X_OK):
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Emulator:
    """A running emulator process. ``host`` is the value for ``BIGTABLE_EMULATOR_HOST``."""

    def __init__(
        self, binary: str | None = None, port: int | None = None, startup_timeout: float = 30.0
    ):
        binary = binary or find_emulator()
        if binary is None:
            raise FileNotFoundError(
                "the Cloud Bigtable emulator (cbtemulator) was not found on PATH nor in the "
                "Google Cloud SDK; install it with `gcloud components install bigtable` or the "
                "google-cloud-cli-bigtable-emulator package"
            )
        self.port = port or _free_port()
        self.host = f"localhost:{self.port}"
        # A file, not a pipe: nobody reads the emulator's log while it runs, and a full pipe
        # would block it.
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [binary, "-host", "localhost", "-port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.process.poll() is not None:
                self._log.seek(0)
                out = self._log.read().decode(errors="replace")
                self._log.close()
                raise RuntimeError(f"{binary} exited with {self.process.returncode}: {out}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("localhost", self.port), timeout=0.5),
            ):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"{binary} did not accept connections on {self.host} "
                    f"within {startup_timeout:g} s"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stops the emulator (its tables are lost)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@contextlib.contextmanager
def running_emulator(port: int | None = None) -> Iterator[Emulator]:
    """A started emulator with ``BIGTABLE_EMULATOR_HOST`` set to it (restored afterwards)."""
    emulator = Emulator(port=port)
    previous = os.environ.get("BIGTABLE_EMULATOR_HOST")
    os.environ["BIGTABLE_EMULATOR_HOST"] = emulator.host
    try:
        yield emulator
    finally:
        if previous is None:
            os.environ.pop("BIGTABLE_EMULATOR_HOST", None)
        else:
            os.environ["BIGTABLE_EMULATOR_HOST"] = previous
        emulator.stop()


def main(argv: list[str] | None = None) -> int:
    """Starts the emulator and waits (Ctrl-C stops it)."""
    parser = argparse.ArgumentParser(
        prog="python -m estimax.tools.bigtable_emulator",
        description=__doc__.split("\n\n")[0].replace("``", ""),
    )
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    args = parser.parse_args(argv)
    try:
        emulator = Emulator(port=args.port)
    except (FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"bigtable_emulator: error: {e}", file=sys.stderr)
        return 2
    print(f"export BIGTABLE_EMULATOR_HOST={emulator.host}", flush=True)
    # `kill` of this process must stop the emulator too, not orphan it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        emulator.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
