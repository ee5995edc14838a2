"""ResNet-50 training on one accelerator machine: images/s, memory, compile time, loop overhead.

``make bench-accelerator`` runs it. On a machine with an NVIDIA GPU (``/dev/nvidia0``) or a
Cloud TPU (``/dev/accel*``, ``/dev/vfio/*``) it first installs the matching extra
(``estimax[cuda13]`` for drivers >= 580, else ``[cuda12]``; ``[tpu]``) into a fresh venv
(``bench/.venv-accelerator``, with ``constraints.txt``) and runs itself there; then, in
bfloat16 (the recipe's precision) at each global batch size of ``--batch_sizes`` (the seeds'
1024, and 256), it measures:

* ``synthetic``: a bare jitted train step of estimax's ResNet-50 recipe (``programs.resnet``'s
  model, SGD with Nesterov momentum) on a batch already on the device: images/s, the step's
  compile time, and the device's peak memory (``memory_stats()['peak_bytes_in_use']``);
* ``estimator, ipl=N``: ``Estimator.train`` with the recipe's ``model_fn`` on host batches
  that never change (no decoding), ``iterations_per_loop`` 1 and 100: steps/s, which shows the
  host loop's cost per step;
* ``real input``: the same with ``imagenet.input_fn`` decoding JPEGs from local TFRecords
  (ImageNet-like fake images written first by ``estimax.tools``), iterations_per_loop 100.

The timed ``train`` calls each end with a checkpoint save, as a real run's do (counted).
Writes its section of ``accelerator.md`` (and ``.json``) in ``bench/results/``, one per device kind
(``bench/result_sections.py``: a run replaces its device's section, the others kept). MLPerf
Training's ResNet-50 reaches ~7,160 images/s per H100 and ~7,940 per H200 (for comparison;
different code).

``--dry_run`` (``make bench-accelerator-dry-run``) does every step but the device, on any
machine: it prints the commands a GPU and a TPU machine would run (the extra installed editable
from this checkout: estimax is not on the package index) and the result file it would write,
then runs the tiny version below through the same code.

On a machine without GPU or TPU it runs a tiny version of itself in the current environment
(``models.resnet.ResNetTinyBottleneck``, the same code with two one-block groups, at 32x32,
batch 8, iterations_per_loop 1 and 5, a few steps): what the test suite runs to keep this
script working; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from result_sections import slug, write_section

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def detect_device() -> str:
    """'gpu', 'tpu' or 'cpu', from what the OS shows (JAX may not be able to use it yet)."""
    if Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").exists():
        return "gpu"
    if list(Path("/dev").glob("accel*")) or list(Path("/dev").glob("vfio/[0-9]*")):
        return "tpu"
    return "cpu"


def nvidia_smi(field: str) -> str | None:
    """The first GPU's ``field`` (``nvidia-smi --query-gpu``), or None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.splitlines() or [""])[0].strip() or None


def gpu_extra() -> str:
    """cuda13 where the driver runs CUDA 13 (>= 580), else cuda12."""
    try:
        return (
            "cuda13" if int((nvidia_smi("driver_version") or "").split(".")[0]) >= 580 else "cuda12"
        )
    except ValueError:
        return "cuda12"


def install_commands(device: str, venv: Path, argv: list[str]) -> list[list[str]]:
    """The commands that install estimax[<extra>] from this checkout and rerun this script."""
    extra = gpu_extra() if device == "gpu" else "tpu"
    python = str(venv / "bin" / "python")
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"), "-e",
         f"{REPO}[{extra}]"],
        [python, __file__, *argv, "--no_install", "--device", device],
    ]  # fmt: skip


def install_and_rerun(device: str, venv: Path, argv: list[str]) -> int:
    """Installs estimax[<extra>] into a fresh venv, then runs this script there."""
    make_venv, install, rerun = install_commands(device, venv, argv)
    if venv.exists():
        import shutil

        shutil.rmtree(venv)
    print(f"bench/accelerator.py: {shlex.join(install)}", flush=True)
    subprocess.run(make_venv, check=True)
    subprocess.run(install, check=True)
    return subprocess.run(rerun, check=False).returncode


def device_name(device: str) -> str | None:
    """The accelerator's name as the OS tells it before JAX runs (None where it cannot)."""
    return nvidia_smi("name") if device == "gpu" else None


def dry_run(args: argparse.Namespace, argv: list[str]) -> int:
    """Every step but the device: the install it would run, its extra, the tiny measurement on
    this CPU through the same code, and the result files the real run would write."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    devices = ["gpu", "tpu"] if args.device in ("auto", "cpu") else [args.device]
    rerun_argv = [a for a in argv if a != "--dry_run"]
    for device in devices:
        commands = install_commands(device, Path(args.venv), rerun_argv)
        extra = commands[1][-1].rsplit("[", 1)[1].rstrip("]")
        if extra not in extras["optional-dependencies"]:
            sys.exit(f"bench/accelerator.py: pyproject.toml has no [{extra}] extra")
        name = device_name(device)
        section = slug(name) if name else "<device kind>"
        print(f"dry run, on a {device.upper()} machine this would run:")
        for cmd in commands:
            print("  " + shlex.join(cmd))
        print(
            f"  and write {RESULTS / 'accelerator'}.md (and .json), section {section}", flush=True
        )
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_accelerator_dry_"))
    out = out if out.suffix == ".json" else out / "accelerator_cpu_tiny.json"
    code = main([*rerun_argv, "--device=cpu", f"--out={out}", "--no_install"])
    print(f"dry run: the tiny CPU measurement through the same code wrote {out} (exit {code})")
    return code


def _peak_bytes(device: Any) -> int | None:
    try:
        return (device.memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - backends without memory stats raise
        return None


def make_records(directory: str, image_size: int, count: int, num_classes: int) -> str:
    """ImageNet-schema TFRecords of fake JPEGs (estimax.tools), local, about ImageNet-sized."""
    from estimax.tools import convert_shards, fake_imagenet

    big = image_size >= 224
    ds = fake_imagenet.fake_dataset(
        count,
        0,
        num_classes=num_classes,
        seed=0,
        min_size=300 if big else image_size,
        max_size=500 if big else 2 * image_size,
    )
    convert_shards.convert_local(ds, directory, {"train": 8}, progress=False)
    return directory


class Bench:
    """The measurements at one global batch size."""

    def __init__(self, args: argparse.Namespace, batch: int, data_dir: str):
        import jax

        from estimax.programs import resnet

        self.args, self.batch, self.data_dir = args, batch, data_dir
        self.cfg = resnet.ResNetConfig(
            resnet_depth=args.depth,
            num_label_classes=args.classes,
            precision="bfloat16",
            train_batch_size=batch,
            write_scalars=False,
        )
        self.device = jax.devices()[0]

    def synthetic(self) -> dict[str, Any]:
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax

        from estimax.data import preprocessing
        from estimax.programs import resnet

        model = resnet.build_model(self.cfg)
        s = self.args.image_size
        rng = np.random.default_rng(0)
        x = jax.device_put(rng.integers(0, 255, (self.batch, s, s, 3), np.uint8), self.device)
        y = jax.device_put(rng.integers(0, self.cfg.num_label_classes, self.batch), self.device)
        variables = jax.jit(lambda k: model.init(k, jnp.zeros((1, s, s, 3)), train=False))(
            jax.random.key(0)
        )
        tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
        state = (variables, tx.init(variables["params"]))

        def step(state, x, y):
            variables, opt = state

            def loss_fn(p):
                images = preprocessing.normalize(x, jnp, dtype=model.dtype)
                logits, new = model.apply(
                    {**variables, "params": p}, images, train=True, mutable=["batch_stats"]
                )
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

            (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
            updates, opt = tx.update(grads, opt, variables["params"])
            params = optax.apply_updates(variables["params"], updates)
            return ({**variables, **new, "params": params}, opt), loss

        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0,)).lower(state, x, y).compile()
        compile_s = time.perf_counter() - t0
        state, loss = compiled(state, x, y)
        jax.block_until_ready(loss)
        t0 = time.perf_counter()
        for _ in range(self.args.steps):
            state, loss = compiled(state, x, y)
        jax.block_until_ready(loss)
        elapsed = time.perf_counter() - t0
        return {
            "images_per_s": self.args.steps * self.batch / elapsed,
            "compile_s": compile_s,
            "peak_bytes": _peak_bytes(self.device),
        }

    def estimator(self, ipl: int, real_input: bool) -> dict[str, Any]:
        """Estimator.train at ``ipl``: unchanging host batches, then (``real_input``) JPEGs
        decoded from the TFRecords, on the same Estimator (its compiled loop is reused)."""
        import jax
        import numpy as np

        import estimax as ex
        from estimax.data import imagenet
        from estimax.programs import resnet

        s = self.args.image_size
        rng = np.random.default_rng(0)
        host_x = rng.integers(0, 255, (self.batch, s, s, 3), np.uint8)
        host_y = rng.integers(0, self.cfg.num_label_classes, self.batch).astype(np.int32)

        def fixed_input_fn(params):
            while True:
                yield host_x, host_y

        config = ex.RunConfig(
            model_dir=tempfile.mkdtemp(prefix="bench_accelerator_"),
            iterations_per_loop=ipl,
            num_shards=jax.local_device_count(),
            save_checkpoints_secs=1e9,
            keep_checkpoint_max=1,
            log_step_count_steps=10**9,
            save_summary_steps=10**9,
        )
        est = ex.Estimator(resnet.make_model_fn(self.cfg), config, train_batch_size=self.batch)
        t0 = time.perf_counter()
        est.train(fixed_input_fn, max_steps=ipl)  # compiles the loop
        first_s = time.perf_counter() - t0
        steps = max(self.args.steps, ipl) // ipl * ipl

        def timed(input_fn: Any) -> dict[str, float]:
            t0 = time.perf_counter()
            est.train(input_fn, steps=steps)
            elapsed = time.perf_counter() - t0
            return {"steps_per_s": steps / elapsed, "images_per_s": steps * self.batch / elapsed}

        out: dict[str, Any] = {"fixed": timed(fixed_input_fn), "first_call_s": first_s}
        if real_input:
            real = imagenet.input_fn(
                self.data_dir, True, image_size=s, seed=0, num_classes=self.cfg.num_label_classes
            )
            out["real"] = timed(real)
        out["steps"] = steps
        return out


# The tiny version's "depth": the recipe's code (programs.resnet) with the tests' tiny ResNet.
TINY_DEPTH = 0


def run(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import jax

    from estimax.models import resnet as resnet_models
    from estimax.ops import native

    if args.depth == TINY_DEPTH:
        resnet_models.RESNET_DEPTHS[TINY_DEPTH] = resnet_models.ResNetTinyBottleneck

    platform = jax.default_backend()
    if device != "cpu" and platform == "cpu":
        sys.exit(f"bench/accelerator.py: a {device.upper()} is present but JAX sees only the CPU")
    work = tempfile.mkdtemp(prefix="bench_accelerator_data_")
    data_dir = make_records(work, args.image_size, args.records, args.classes)
    rows = []
    for batch in args.batch_sizes:
        bench = Bench(args, batch, data_dir)
        row: dict[str, Any] = {"batch": batch}
        try:
            row["synthetic"] = bench.synthetic()
            for ipl in args.iterations_per_loop:
                last = ipl == max(args.iterations_per_loop)
                row[f"estimator ipl={ipl}"] = bench.estimator(ipl, real_input=last)
        except Exception as e:  # noqa: BLE001 - e.g. out of device memory at this batch
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    d = jax.devices()[0]
    return {
        "device": f"{jax.device_count()} x {d.device_kind} ({platform})",
        "jax": jax.__version__,
        "cpu_kernels": native.status() if platform == "cpu" else "n/a",
        "model": (f"ResNet-{args.depth}" if args.depth != TINY_DEPTH else "tiny ResNet")
        + f", {args.image_size}x{args.image_size}, bfloat16",
        "steps": args.steps,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tiny": args.tiny,
        "rows": rows,
    }


def markdown(res: dict[str, Any]) -> str:
    ipls = sorted(
        {int(k.split("=")[1]) for r in res["rows"] for k in r if k.startswith("estimator")}
    )
    lines = [
        f"# {res['model']} training on {res['device']}",
        "",
        f"jax {res['jax']}; {res['steps']} timed steps per figure; {res['date']}."
        + (" TINY CPU VERSION (a smoke run: the figures mean nothing)." if res["tiny"] else "")
        + " MLPerf Training ResNet-50: ~7,160 images/s per H100, ~7,940 per H200.",
        "",
        "| global batch | synthetic img/s | compile s | peak device memory | "
        + " | ".join(f"ipl={i} steps/s" for i in ipls)
        + " | real input img/s (ipl="
        + str(max(ipls, default=0))
        + ") |",
        "|---|---|---|---|" + "---|" * len(ipls) + "---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['error']} |")
            continue
        syn = r["synthetic"]
        peak = f"{syn['peak_bytes'] / 2**30:.1f} GiB" if syn["peak_bytes"] else "n/a"
        cells = [f"{syn['images_per_s']:.1f}", f"{syn['compile_s']:.1f}", peak]
        cells += [f"{r[f'estimator ipl={i}']['fixed']['steps_per_s']:.2f}" for i in ipls]
        cells.append(f"{r[f'estimator ipl={max(ipls)}']['real']['images_per_s']:.1f}")
        lines.append(f"| {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "gpu", "tpu"), default="auto")
    p.add_argument("--no_install", action="store_true", help="run in this environment")
    p.add_argument("--venv", default=str(REPO / "bench" / ".venv-accelerator"))
    p.add_argument("--tiny", action="store_true", help="the CPU smoke version (default on CPU)")
    p.add_argument("--batch_sizes", default=None, help="global batch sizes, e.g. 1024,256")
    p.add_argument("--iterations_per_loop", default=None, help="e.g. 1,100")
    p.add_argument("--steps", type=int, default=None, help="timed steps per figure")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--dry_run",
        action="store_true",
        help="no install, no device: print what a GPU/TPU run would install, run and write, "
        "then run the tiny CPU version through the same code",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        return dry_run(args, argv)
    device = detect_device() if args.device == "auto" else args.device
    if device != "cpu" and not args.no_install:
        return install_and_rerun(device, Path(args.venv), argv)
    args.tiny = args.tiny or device == "cpu"
    tiny = args.tiny
    args.depth, args.image_size = (TINY_DEPTH, 32) if tiny else (50, 224)
    args.classes = 10 if tiny else 1000
    args.records = 64 if tiny else 2048
    args.batch_sizes = [
        int(b) for b in (args.batch_sizes or ("8" if tiny else "1024,256")).split(",")
    ]
    args.iterations_per_loop = [
        int(i) for i in (args.iterations_per_loop or ("1,5" if tiny else "1,100")).split(",")
    ]
    args.steps = args.steps or (5 if tiny else 200)
    res = run(args, device)
    name = "cpu_tiny" if tiny else res["device"].split(" x ", 1)[1].split(" (")[0]
    if args.out:  # a file of its own (the tests' tiny run), not the results
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))
    else:
        title = "ResNet-50 training on one accelerator (bench/accelerator.py)"
        write_section("accelerator", slug(name), markdown(res), res, title)
    print(markdown(res))
    return 1 if any("error" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
