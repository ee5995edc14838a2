"""What starting a program costs: modules that only some runs need stay out of its import.

Every process of a program imports its module first (a pod test job starts 8 to 32 of them;
a user's ``--help`` or mistyped flag is only that import). ``--compile_for``'s compiler and
the step builder are imported where they are used (``estimax.programs.common.compile_job``,
``estimax.programs.configs.check_accumulation``), the ``--compile_for`` flag's help takes
its topology names from the light ``estimax.compile.topologies``, and ``estimax.models`` imports
a network's file (and reads every file for its registry) only when asked for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imported on first use only: a program's import (its flags, its --help) must not pull them in.
LAZY = (
    "estimax.compile.compile",
    "estimax.compile.search",
    "estimax.estimator.step_builder",
    "estimax.estimator.steps",
    # The other families' networks: estimax.models finds its registry on first use.
    "estimax.models.efficientnet",
    "estimax.models.inception_v3",
    "estimax.models.inception_v4",
    "estimax.models.resnet",
    "estimax.models.vit",
)


def test_importing_a_program_leaves_out_what_only_some_runs_need():
    # The names are real modules: a renamed one would make the check below pass vacuously.
    for name in LAZY:
        assert importlib.util.find_spec(name) is not None, name
    code = (
        "import json, sys\n"
        "from absl import flags\n"
        "import estimax.programs.mnist\n"
        "fv = flags.FlagValues()\n"
        "estimax.programs.mnist.define_flags(fv)\n"
        f"loaded = [m for m in {LAZY!r} if m in sys.modules]\n"
        "print(json.dumps({'loaded': loaded, 'compile_for': fv['compile_for'].help}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    result = json.loads(out.stdout)
    assert result["loaded"] == []
    # Its flags (what --help shows) are still defined, the topology names in their help.
    from estimax.compile.topologies import KNOWN_TOPOLOGIES

    assert all(name in result["compile_for"] for name in KNOWN_TOPOLOGIES)
