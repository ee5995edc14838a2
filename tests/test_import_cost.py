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

# Imported by tensorboardX for its own S3 and GCS event writers, which estimax replaces
# (estimax.storage.register_summary_writers): 0.5 CPU-s of every process that writes summaries.
CLIENTS = ("boto3", "google.cloud.storage")


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
        # A run's summaries and its description, as a program writes them: tensorboardX is
        # imported without the S3 and GCS clients its own (replaced) writers would use.
        "from estimax.estimator.summaries import Summaries\n"
        "from estimax.programs import modes\n"
        "import tempfile\n"
        "d = tempfile.mkdtemp()\n"
        "w = Summaries(d)\n"
        "w.scalars(1, {'loss': 0.5})\n"
        "w.close()\n"
        "modes.write_run_description(d, ['a note'])\n"
        "from tensorboardX import record_writer as rw\n"
        f"clients = [m for m in {CLIENTS!r} if m in sys.modules]\n"
        "writers = {p: type(rw.REGISTERED_FACTORIES.get(p)).__name__ for p in ('gs', 's3')}\n"
        "from estimax.estimator.summaries import scalar_values\n"
        "print(json.dumps({'loaded': loaded, 'compile_for': fv['compile_for'].help,\n"
        "    'clients': clients, 'writers': writers, 'scalars': scalar_values(d)[1]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    result = json.loads(out.stdout)
    assert result["loaded"] == []
    assert result["clients"] == [] and result["scalars"] == {"loss": 0.5}
    # gs:// and s3:// event files go through estimax's fsspec writers instead.
    assert result["writers"] == {"gs": "_SpooledWriterFactory", "s3": "_SpooledWriterFactory"}
    # Its flags (what --help shows) are still defined, the topology names in their help.
    from estimax.compile.topologies import KNOWN_TOPOLOGIES

    assert all(name in result["compile_for"] for name in KNOWN_TOPOLOGIES)
