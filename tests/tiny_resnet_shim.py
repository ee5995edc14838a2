"""The ``resnet`` program, or the ``estimax`` command, with the tests' tiny ResNet as its network.

``python tests/tiny_resnet_shim.py resnet ARGS...`` runs ``python -m estimax.programs.resnet
ARGS`` and ``python tests/tiny_resnet_shim.py estimax ARGS...`` runs ``python -m estimax ARGS``
unchanged but for one thing: whatever ``--resnet_depth`` says, the network is
``estimax.models.ResNetTiny`` (two blocks of 8 filters), as the in-process program tests of
tests/test_programs.py have it. For tests of the command line, the processes and what they write,
not of the network: ResNet-18 took most of such a run's time compiling on CI's two cores, and
the networks themselves are tested in tests/test_models.py. Flags, ``flags.json`` and the
checkpoints' layout are the program's own.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from estimax import command  # noqa: E402
from estimax.models.resnet import ResNetTiny  # noqa: E402
from estimax.programs import resnet  # noqa: E402


def main() -> None:
    """Runs the program named by ``sys.argv[1]`` on the rest of the command line."""
    program, argv = sys.argv[1], sys.argv[2:]
    resnet.resnet_v1 = lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
    sys.argv = [program, *argv]  # absl and the estimax command read sys.argv
    {"resnet": resnet.run, "estimax": command.run}[program]()


if __name__ == "__main__":
    main()
