"""The seeds' jobs compiled for the TPU slices they were written for, on a machine with none.

    .venv-tpu/bin/python bench/tpu_compile.py --program=resnet --topology=v2:2x2   # one pair
    .venv-tpu/bin/python bench/tpu_compile.py --all                                # what is left
    .venv-tpu/bin/python bench/tpu_compile.py --table                              # the .md only
    .venv-tpu/bin/python bench/tpu_compile.py --program=resnet --topology=v5e:2x4 --variant=fsdp

``--variant`` adds a layout's flags to the program's command line (``VARIANTS``: spatial
partitioning, FSDP, rematerialisation); its rows sit beside the default layout's, so the table
shows what each layout changes (per-device arguments, temporaries, collectives).

Each (program, topology) runs the program's own command line with ``--compile_for`` (its
model_fn, mesh, precision, EMA, donated state and batch sizes, exactly as ``--compile_for``
does), in this process, and appends its reports to ``bench/results/tpu_compile.json`` (a pair
already there is replaced); ``bench/results/tpu_compile.md`` is rewritten from the JSON each time.
ResNet-50 and Inception v3 take minutes per step on a small machine: run one pair at a time,
in the background. Needs libtpu (``.venv-tpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TOPOLOGIES = ("v2:2x2", "v3:2x2", "v4:2x2x1", "v5e:2x4", "v6e:2x4")
# GPU targets (estimax.compile.gpu_compile), run one at a time in .venv-cuda (not by --all,
# which runs in .venv-tpu): .venv-cuda/bin/python bench/tpu_compile.py --program=resnet
# --topology=h100:8.
GPU_TOPOLOGIES = ("h100:8", "a100-80gb:8")

# The seeds' command lines, less the TPU-locating and storage flags (they change nothing here).
PROGRAMS: dict[str, tuple[str, list[str], str]] = {
    # resnet_main.py's defaults: ResNet-50, global batch 1024 (train and eval), bfloat16.
    "resnet": ("estimax.programs.resnet", [], "ResNet-50, batch 1024, bfloat16 (defaults)"),
    # Seed 000 (the Cloud TPU Inception v3 tutorial): its flags; batch 1024, float32, EMA.
    "inception_v3": (
        "estimax.programs.inception_v3",
        [
            "--learning_rate=0.165",
            "--train_steps=250000",
            "--iterations=500",
            "--use_data=real",
            "--mode=train_and_eval",
            "--train_steps_per_eval=2000",
            "--data_dir=gs://bucket/data",
        ],
        "Inception v3 as seed 000 runs it: batch 1024, float32, RMSProp, EMA",
    ),
    # mnist_tpu.py's defaults: batch 1024.
    "mnist": ("estimax.programs.mnist", [], "MNIST CNN, batch 1024, float32 (defaults)"),
    # big_vision's ViT-L/16 with its Adam (4.9 GB of state in float32, mu in bfloat16) at a
    # global batch of 512 (64 per v5e chip).
    "vit_l16": (
        "estimax.programs.vit",
        ["--model_name=vit-l16", "--train_batch_size=512", "--eval_batch_size=512"],
        "ViT-L/16, batch 512, float32 (the program's default), Adam (mu in bfloat16)",
    ),
}
# ViT-L/16 at a global batch of 3,584 (448 per v5e chip, near big_vision's 4,096): the batch
# at which --remat=full alone does not fit a v5e chip's 16 GiB and FSDP with it does (issue
# #40's check). Eval stays at 512: only the train step's memory is in question.
PROGRAMS["vit_l16_3584"] = (
    "estimax.programs.vit",
    ["--model_name=vit-l16", "--train_batch_size=3584", "--eval_batch_size=512"],
    "ViT-L/16, batch 3,584, float32 (the program's default), Adam (mu in bfloat16)",
)
# EfficientNet-B7 at its 600x600 resolution (issue #40's case of activations that do not fit):
# 8 images per v5e chip.
PROGRAMS["efficientnet_b7"] = (
    "estimax.programs.efficientnet",
    ["--model_name=efficientnet-b7", "--train_batch_size=64", "--eval_batch_size=64"],
    "EfficientNet-B7, 600x600, batch 64, float32 (the program's default)",
)
# The layouts of issue #40, as their flags.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "spatial": ["--num_cores_per_replica=2", "--input_partition_dims=1,2,1,1"],
    "fsdp": ["--fsdp_min_size_mb=4"],
    "remat": ["--remat=full"],
    # FSDP under --remat: each block gathers its own parameters inside its remat region.
    "fsdp_remat": ["--fsdp_min_size_mb=4", "--remat=full"],
    # The same in bfloat16 (the programs' --precision): a block's weights cast to bfloat16 are
    # values its remat region computes, not arguments.
    "fsdp_remat_bf16": ["--fsdp_min_size_mb=4", "--remat=full", "--precision=bfloat16"],
    # Spatial partitioning at ResNet's batch 1,024 halved: on v5e:2x4, 4 replicas of 2 cores
    # each hold the 128 images a replica holds in the default row (8 replicas of 1 core), each
    # core half of each image. At the same global batch ("spatial") no device holds less.
    "spatial_512": [
        "--num_cores_per_replica=2",
        "--input_partition_dims=1,2,1,1",
        "--train_batch_size=512",
        "--eval_batch_size=512",
    ],
}


def machine() -> dict[str, Any]:
    """The host the compiles ran on (they use only its CPU)."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "load_start": os.getloadavg()[0]}


def run_pair(
    program: str, topology: str, variant: str = "default", search: bool = True
) -> dict[str, Any]:
    """Compiles one program's train and eval steps for one topology under one layout; its
    reports and times. ``search=False``: a step that does not fit is reported as it is, without
    the batch search's further compiles (minutes each for a large model)."""
    import importlib

    from absl import flags

    from estimax.compile import compile as compile_lib
    from estimax.programs import common

    module_name, argv, what = PROGRAMS[program]
    argv = [*argv, *VARIANTS[variant]]
    module = importlib.import_module(module_name)
    fv = flags.FlagValues()
    module.define_flags(fv)
    fv([program, f"--compile_for={topology}", *argv])
    if not search:
        whole = compile_lib.compile_for

        def no_search(*args: Any, **kwargs: Any) -> Any:
            return whole(*args, **{**kwargs, "search": False})

        compile_lib.compile_for = no_search  # this process runs one pair
    start, host = time.perf_counter(), machine()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            results = module.run_from_flags(fv)
            reports, fatal = results["compile_for"], None
        except common.DoesNotFit as e:
            reports, fatal = [r.as_dict() for r in e.reports], str(e)
    host["load_end"] = os.getloadavg()[0]
    return {
        "program": program,
        "variant": variant,
        "what": what,
        "argv": argv,
        "topology": topology,
        "reports": reports,
        "lines": printed.getvalue().splitlines(),
        "fatal": fatal,
        "wall_s": time.perf_counter() - start,
        "machine": host,
        "versions": versions(),
    }


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for p in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin"):
        with contextlib.suppress(metadata.PackageNotFoundError):  # one compiler per venv
            found[p] = metadata.version(p)
    return found


def load(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else []


def save(path: Path, rows: list[dict[str, Any]]) -> None:
    order = {p: i for i, p in enumerate(PROGRAMS)}
    targets = TOPOLOGIES + GPU_TOPOLOGIES
    variants = list(VARIANTS)
    rows.sort(
        key=lambda r: (
            order.get(r["program"], 99),
            targets.index(r["topology"]),
            variants.index(r.get("variant", "default")),
        )
    )
    path.write_text(json.dumps(rows, indent=1) + "\n")
    path.with_suffix(".md").write_text(table(rows))


def _gib(x: float) -> str:
    """GiB, or MiB (with its unit) below a tenth of one."""
    return f"{x / (1 << 30):.2f}" if x >= (1 << 30) / 10 else f"{x / (1 << 20):.3g} MiB"


def _row(run: dict[str, Any], r: dict[str, Any]) -> str:
    variant = run.get("variant", "default")
    head = f"| {run['program']} | {variant} | {run['topology']} ({r['device_kind']} "
    head += f"x{r['num_devices']}) "
    head += f"| {r['step']} | {r['global_batch']} | {r['dtypes']} "
    if not r["fits"]:
        search = r.get("search") or {}
        note = f"no; largest that fits: {search.get('fits')}" if search else "no"
        # The compiler's own words on what it needed (a step that does not fit has no sizes).
        said = (r.get("error") or "").replace("|", "/")
        return head + f"| {note} | {said} | | | | | | | {r['compile_s']:.0f} |"
    per_dev = r["examples_per_s_per_device"]
    chip = per_dev * r["devices_per_chip"]
    xla = r.get("xla_estimate_s")
    return head + (
        f"| yes | {_gib(r['memory_bytes'])} of {_gib(r['hbm_bytes'])} "
        f"({_gib(r['argument_bytes'])} / {_gib(r['temp_bytes'])} / {_gib(r['code_bytes'])}) "
        f"| {r['flops'] / 1e12:.3g} | {r['bytes_accessed'] / 1e9:.3g} "
        f"| {r['roofline_s'] * 1e3:.3g} ({r['bound']}) "
        f"| {per_dev:,.0f} / {chip:,.0f} "
        f"| {'' if xla is None else f'{xla * 1e3:.3g}'} | {_collectives(r)} "
        f"| {r['compile_s']:.0f} |"
    )


def _collectives(r: dict[str, Any]) -> str:
    """The step's collectives, ``all-reduce 161 (0.20)``: count and GiB per device per step."""
    found = r.get("collectives")
    if found is None:
        return "(not recorded)"
    return ", ".join(f"{op} {n} ({_gib(b)})" for op, (n, b) in sorted(found.items())) or "none"


def _compiler(versions: dict[str, str]) -> str:
    """The XLA compiler a run used: libtpu's, or the CUDA plugin's for a GPU target."""
    if "libtpu" in versions:
        return f"libtpu {versions['libtpu']}"
    return f"jax-cuda12-plugin {versions.get('jax-cuda12-plugin')}"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of every pair measured so far."""
    lines = [
        "# The seeds' jobs compiled for TPU slices, on a machine without a TPU",
        "",
        "`bench/tpu_compile.py` (one `--compile_for` per program and topology; XLA's TPU compiler "
        "from libtpu, no TPU). Memory, flops and bytes are the compiled executable's own "
        "(`memory_analysis()`, `cost_analysis()`), per device: a TensorCore on v2/v3/v4 (two "
        "per chip), a chip on v5e/v6e. Roofline = max(flops / peak bf16, bytes / HBM "
        "bandwidth) with the published per-chip figures (`estimax/compile/compile.py`'s "
        "`TPU_CHIPS`, each with its Cloud TPU docs page). Compile times are this machine's "
        "(see each run's load below): the train step's includes lowering. The pairs ran one "
        "process each, two or three at a time, with one version of the code (the first, resnet "
        "on v2:2x2, before the executable's serialized size was added to the report).",
        "",
        "| program | layout | topology | step | global batch | matmul dtypes | fits | memory GiB "
        "per device (args / temp / code) | TFLOP per device per step | GB accessed per device "
        "per step | roofline ms/step (bound) | roofline examples/s per device / per chip | "
        "XLA's own estimate ms | collectives per step: count (GiB produced) | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in rows:
        lines.extend(_row(run, r) for r in run["reports"])
    lines += ["", "## Runs", ""]
    for run in rows:
        m = run["machine"]
        lines.append(
            f"* {run['program']} ({run.get('variant', 'default')}) on {run['topology']}: "
            f"{run['what']} {' '.join(VARIANTS[run.get('variant', 'default')])}; "
            f"{run['wall_s']:.0f} s "
            f"wall on {m['cpu']} ({m['cores']} cores, load {m['load_start']:.1f} -> "
            f"{m['load_end']:.1f}); jax {run['versions']['jax']}, {_compiler(run['versions'])}."
            + (f" FATAL: {run['fatal']}" if run["fatal"] else "")
        )
    lines += ["", *READING]
    return "\n".join(lines) + "\n"


READING = [
    "## Published per-chip figures, for comparison",
    "",
    "* ResNet-50 training, TPU v4: ~3,480 images/s per chip (MLPerf Training v1.0, Google's "
    "v4 submissions, as issue 30 quotes it; tuned TensorFlow/JAX code with real input). The "
    "roofline above for the same batch per chip is an upper bound of the same kind: the "
    "published figure sits below it by what a real step loses to the rest.",
    "* Per-chip HBM, bandwidth and peak bf16 FLOP/s: `TPU_CHIPS` in "
    "`estimax/compile/compile.py`, each from its Cloud TPU docs page (v2 from the CACM paper "
    "that page cites).",
    "",
    "## What the roofline can and cannot tell",
    "",
    "* It can tell whether a step fits (the compiler's own verdict, with its memory split into "
    "arguments, temporaries and code), which resource bounds it (compute when flops / peak "
    "exceeds bytes / bandwidth), and a speed no implementation of that program can beat on "
    "that chip; and how the same job moves between generations (more HBM, faster chips).",
    "* It cannot tell the measured speed: it ignores the time XLA cannot overlap, the "
    "cross-chip all-reduce of the gradients, the host's input pipeline and the loop's host "
    "work, padding of small channel counts to the MXU's tiles, and clock and power limits. "
    "Peak bf16 FLOP/s is also the wrong peak for a float32 program (Inception v3 at the seed's "
    "float32, MNIST): its matmuls run as several bf16 passes, so its roofline is optimistic by "
    "up to that factor.",
    "* `XLA's own estimate` is the TPU compiler's cost model (`cost_analysis()`'s "
    "`optimal_seconds`): it knows the chip better than the two-number roofline and is still "
    "not a measurement.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", choices=sorted(PROGRAMS))
    parser.add_argument("--topology", choices=TOPOLOGIES + GPU_TOPOLOGIES)
    parser.add_argument("--all", action="store_true", help="every pair not in --out yet")
    parser.add_argument("--table", action="store_true", help="only rewrite the .md")
    parser.add_argument("--out", type=Path, default=RESULTS / "tpu_compile.json")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="default")
    parser.add_argument(
        "--no_search", action="store_true", help="no batch search for a step that does not fit"
    )
    args = parser.parse_args()
    rows = load(args.out)
    if args.table:
        save(args.out, rows)
        return 0
    done = {(r["program"], r["topology"]) for r in rows if r.get("variant", "default") == "default"}
    if args.all:
        pairs = [(p, t) for p in PROGRAMS for t in TOPOLOGIES if (p, t) not in done]
    elif args.program:
        pairs = [(args.program, t) for t in ([args.topology] if args.topology else TOPOLOGIES)]
    else:
        parser.error("give --program [--topology], or --all, or --table")
    for program, topology in pairs:
        run = run_pair(program, topology, args.variant, search=not args.no_search)
        print("\n".join(run["lines"]), flush=True)
        # Runs in other processes may append to the same file: read, add and write under a lock.
        with open(args.out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            key = (program, topology, args.variant)
            rows = [
                r
                for r in load(args.out)
                if (r["program"], r["topology"], r.get("variant", "default")) != key
            ]
            save(args.out, [*rows, run])
    return 0


if __name__ == "__main__":
    sys.exit(main())
