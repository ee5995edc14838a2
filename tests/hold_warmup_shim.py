"""``estimax serve`` with each version's warm-up held until the test lets it go.

``python tests/hold_warmup_shim.py FIFO serve ARGS...`` runs ``estimax serve ARGS`` unchanged
but for one thing: before a version's warm-up records are replayed it prints ``warm-up held:
<version path>`` and reads the FIFO, which blocks until the test opens it for writing and
closes it; then the records are replayed as usual. So a test sees the server at the moment a
version is loaded and checked but not yet warmed, for as long as it needs, with no sleep
(tests/test_tf_serving_compat.py's readiness test).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from estimax import command  # noqa: E402
from estimax.serving import warmup  # noqa: E402


def main() -> int:
    fifo, argv = sys.argv[1], sys.argv[2:]
    replay = warmup.replay

    def held(servable, version_path, core, iterations=1):
        print(f"warm-up held: {version_path}", flush=True)
        with open(fifo, "rb") as f:  # until the test has written and closed its end
            f.read()
        return replay(servable, version_path, core, iterations)

    warmup.replay = held  # read by ServingCore.add for each model it serves
    return command.main(argv)


if __name__ == "__main__":
    sys.exit(main())
