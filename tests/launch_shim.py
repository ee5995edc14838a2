"""A stand-in for the ``resnet`` program in the job-spec tests (tests/test_job_specs.py).

It parses its command line exactly as ``resnet`` does (a flag resnet lacks, or a bad value,
fails here as there), says which mode this process would run (an evaluator task of a cluster
spec evaluates), then runs the launch instead of training: ``estimax doctor --launch`` with the
same cluster flags -- detection, the check with every other process, joining JAX.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from estimax import doctor  # noqa: E402
from estimax.programs import configs, modes, resnet  # noqa: E402


def main() -> int:
    fv = flags.FlagValues()
    resnet.define_flags(fv)
    fv(sys.argv)
    loop = configs.LoopConfig(mode=fv.mode, train_steps=1, steps_per_eval=1)
    print(f"resnet: --data_dir={fv.data_dir} --model_dir={fv.model_dir}", flush=True)
    print(f"resnet: mode {modes.for_cluster_role(loop).mode}", flush=True)
    return doctor.launch_report(fv.coordinator_address, fv.num_processes, fv.process_id, 60)


if __name__ == "__main__":
    sys.exit(main())
