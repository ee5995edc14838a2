"""Training throughput on the CPU: JAX reference vs JAX + estimax.ops vs PyTorch eager.

One run measures, side by side and in interleaved rounds (medians reported), the
train images/s of

* the seeds' MNIST CNN (28x28x1, batch 128): conv5x5 32 relu, maxpool 2/2,
  conv5x5 64 relu, maxpool 2/2, dense 128 relu, dropout 0.4, dense 10;
* ResNet-50 v1 (224x224x3, batch 16; ``estimax.models.resnet.ResNet50``, and a
  PyTorch copy of the same architecture: stride on the 3x3, projection in every group),

for fp32 and bf16 (JAX: ``dtype=bfloat16`` compute with fp32 params; PyTorch:
``torch.autocast('cpu', bfloat16)``), with SGD + momentum 0.9 and softmax cross-entropy.

JAX variants (a variant name is ``jax`` plus optional ``+ops`` / ``+malloc``):
  ``jax``             -- plain ``nn.Conv`` / ``nn.max_pool`` (XLA:CPU's own gradients);
  ``+ops``            -- the same model built with ``estimax.ops.conv_general_dilated``
                         and ``estimax.ops.max_pool``;
  ``+xla``            -- with ``+ops``: estimax.ops without its oneDNN kernels (the pure-XLA
                         formulations, as where ``estimax.ops.native`` is not built);
  ``+malloc``         -- ``estimax.ops.tune_cpu_allocator()`` is in effect while timing
                         (toggled per variant inside the one process; the others run
                         with ``restore_cpu_allocator()``, glibc's steady-state default).
  ``+noynn``          -- in a worker process started with XLA:CPU's YNNPACK fusions off
                         (``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=``; the flag is
                         read once per process, so these variants cannot share it);
  ``+onednn2``        -- in a worker process loading ``--onednn2_lib``: the kernels of the
                         previous build (oneDNN 2.6 from Debian's libdnnl-dev, built from the
                         source before the port), for a same-machine comparison.
Worker variants are timed in the same interleaved rounds as the others (one request per line).

HARNESS: ``--harness=bare`` (default) times a bare ``jax.jit`` train step
(``donate_argnums``); ``--harness=estimator`` times ``estimax.Estimator.train`` on the same
model and batch (``EstimatorRunner``; each timed call ends with one checkpoint save).

PyTorch runs in ``bench/.venv-torch`` (``pip install torch==2.13.0 numpy``), as a
worker subprocess that answers one timing request per line, so PyTorch rounds
interleave with the JAX rounds without PyTorch in estimax's environment.

Usage::

    .venv/bin/python bench/train_cpu.py [--models mnist,resnet50] [--dtypes float32,bfloat16]
        [--rounds 3] [--resnet_rounds 2] [--mnist_steps 10] [--resnet_steps 2]

Writes its section of ``bench/results/train_cpu.{json,md}`` (one per CPU kind, harness, ISA cap
and dtype interleaving; ``bench/result_sections.py``), or ``--out`` and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from result_sections import cpu_kind, slug, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PY = os.path.join(HERE, ".venv-torch", "bin", "python")
BATCH = {"mnist": 128, "resnet50": 16}
SHAPE = {"mnist": (28, 28, 1), "resnet50": (224, 224, 3)}
CLASSES = {"mnist": 10, "resnet50": 1000}

# ============================================================================ PyTorch worker


def torch_worker() -> None:
    """Reads ``model dtype steps`` lines on stdin, answers ``{"img_s": ...}`` lines."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    torch.manual_seed(0)

    class MnistCNN(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = tnn.Conv2d(1, 32, 5, padding=2)
            self.conv2 = tnn.Conv2d(32, 64, 5, padding=2)
            self.fc1 = tnn.Linear(7 * 7 * 64, 128)
            self.fc2 = tnn.Linear(128, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)
            x = F.dropout(F.relu(self.fc1(x.flatten(1))), 0.4, self.training)
            return self.fc2(x)

    class Bottleneck(tnn.Module):
        def __init__(self, cin, f, stride, project):
            super().__init__()
            self.c1, self.b1 = tnn.Conv2d(cin, f, 1, bias=False), tnn.BatchNorm2d(f)
            self.c2, self.b2 = tnn.Conv2d(f, f, 3, stride, 1, bias=False), tnn.BatchNorm2d(f)
            self.c3, self.b3 = tnn.Conv2d(f, 4 * f, 1, bias=False), tnn.BatchNorm2d(4 * f)
            self.proj = (
                tnn.Sequential(
                    tnn.Conv2d(cin, 4 * f, 1, stride, bias=False), tnn.BatchNorm2d(4 * f)
                )
                if project
                else None
            )

        def forward(self, x):
            s = self.proj(x) if self.proj is not None else x
            y = F.relu(self.b1(self.c1(x)))
            y = F.relu(self.b2(self.c2(y)))
            return F.relu(self.b3(self.c3(y)) + s)

    class ResNet50(tnn.Module):
        def __init__(self):
            super().__init__()
            self.stem = tnn.Sequential(
                tnn.Conv2d(3, 64, 7, 2, 3, bias=False),
                tnn.BatchNorm2d(64),
                tnn.ReLU(),
                tnn.MaxPool2d(3, 2, 1),
            )
            blocks, cin = [], 64
            for g, n in enumerate((3, 4, 6, 3)):
                f = 64 * 2**g
                for i in range(n):
                    blocks.append(Bottleneck(cin, f, 2 if (i == 0 and g > 0) else 1, i == 0))
                    cin = 4 * f
            self.blocks = tnn.Sequential(*blocks)
            self.fc = tnn.Linear(2048, 1000)

        def forward(self, x):
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

    built: dict[str, Any] = {}
    for line in sys.stdin:
        model_name, dtype, steps = line.split()
        steps = int(steps)
        if model_name not in built:
            model = MnistCNN() if model_name == "mnist" else ResNet50()
            model = model.to(memory_format=torch.channels_last).train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            h, w, c = SHAPE[model_name]
            x = torch.randn(BATCH[model_name], c, h, w).to(memory_format=torch.channels_last)
            y = torch.randint(0, CLASSES[model_name], (BATCH[model_name],))
            built[model_name] = (model, opt, x, y)
        model, opt, x, y = built[model_name]

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach().item()

        step()  # warm-up (allocator, oneDNN primitive cache)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        dt = time.perf_counter() - t0
        print(json.dumps({"img_s": steps * BATCH[model_name] / dt}), flush=True)


# ============================================================================ JAX side


def _mnist_module(conv_fn, pool_fn, dtype):
    """The seeds' MNIST CNN (estimax.models.mnist) with injectable conv / max-pool."""
    import functools

    import flax.linen as nn

    from estimax.models.mnist import MnistCNN

    return MnistCNN(
        dtype=dtype, conv=functools.partial(nn.Conv, conv_general_dilated=conv_fn), max_pool=pool_fn
    )


def _resnet_module(conv_fn, pool_fn, dtype):
    import functools

    import flax.linen as nn

    from estimax.models import resnet

    conv = functools.partial(nn.Conv, conv_general_dilated=conv_fn)
    return resnet.ResNet50(num_classes=1000, dtype=dtype, conv=conv, max_pool=pool_fn)


class JaxRunner:
    """A compiled train step for one (model, dtype, variant), and its timing."""

    def __init__(self, model_name: str, dtype: str, variant: str):
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from jax import lax

        from estimax import ops
        from estimax.ops import native

        parts = variant.split("+")
        if parts[0] != "jax" or not set(parts[1:]) <= {"ops", "malloc", "xla", "noynn", "onednn2"}:
            raise ValueError(
                f"train_cpu.py: --variants entry {variant!r} unknown; expected jax, "
                "jax+ops, jax+malloc, jax+ops+malloc, jax+ops+malloc+xla or torch"
            )
        self.tuned_malloc = "malloc" in parts
        conv_fn = ops.conv_general_dilated if "ops" in parts else lax.conv_general_dilated
        pool_fn = ops.max_pool if "ops" in parts else nn.max_pool
        jdt = jnp.dtype(dtype)
        build = _mnist_module if model_name == "mnist" else _resnet_module
        self.model = build(conv_fn, pool_fn, jdt)
        self.batch = BATCH[model_name]
        h, w, c = SHAPE[model_name]
        rng = np.random.default_rng(0)
        self.x = jnp.asarray(rng.standard_normal((self.batch, h, w, c)), jnp.float32)
        self.y = jnp.asarray(rng.integers(0, CLASSES[model_name], self.batch), jnp.int32)
        variables = jax.jit(
            lambda k: self.model.init({"params": k, "dropout": k}, self.x, train=False)
        )(jax.random.key(0))
        params = variables["params"]
        self.extra = {k: v for k, v in variables.items() if k != "params"}
        tx = optax.sgd(0.01, momentum=0.9)
        self.state = (params, self.extra, tx.init(params), jax.random.key(1))
        model = self.model

        def train_step(state, x, y):
            params, extra, opt_state, key = state
            key, drop = jax.random.split(key)

            def loss_fn(p):
                logits, new_extra = model.apply(
                    {"params": p, **extra},
                    x,
                    train=True,
                    rngs={"dropout": drop},
                    mutable=list(extra),
                )
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
                return loss, new_extra

            (loss, new_extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), new_extra, opt_state, key), loss

        self.step = jax.jit(train_step, donate_argnums=(0,))
        t0 = time.perf_counter()
        with native.native_kernels("xla" not in parts):  # traced (and compiled) here
            self.state, loss = self.step(self.state, self.x, self.y)
        jax.block_until_ready(loss)
        self.compile_s = time.perf_counter() - t0

    def images_per_sec(self, steps: int) -> float:
        import jax

        from estimax import ops

        if self.tuned_malloc:
            ops.tune_cpu_allocator()
        else:
            ops.restore_cpu_allocator()
        self.state, loss = self.step(self.state, self.x, self.y)  # warm-up
        jax.block_until_ready(loss)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, loss = self.step(self.state, self.x, self.y)
        jax.block_until_ready(loss)
        return steps * self.batch / (time.perf_counter() - t0)


class EstimatorRunner:
    """``estimax.Estimator.train`` on the same model and fixed batch, timed per ``train`` call."""

    def __init__(self, model_name: str, dtype: str, variant: str):
        import tempfile

        import jax.numpy as jnp
        import numpy as np
        import optax
        from flax import linen as nn
        from jax import lax

        import estimax as ex
        from estimax import ops
        from estimax.ops import native

        parts = variant.split("+")
        self.tuned_malloc = "malloc" in parts
        conv_fn = ops.conv_general_dilated if "ops" in parts else lax.conv_general_dilated
        pool_fn = ops.max_pool if "ops" in parts else nn.max_pool
        build = _mnist_module if model_name == "mnist" else _resnet_module
        self.batch = BATCH[model_name]
        h, w, c = SHAPE[model_name]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((self.batch, h, w, c)).astype(np.float32)
        y = rng.integers(0, CLASSES[model_name], self.batch).astype(np.int32)

        def model_fn(features, labels, mode, params):
            # Built inside model_fn, as a user would, so the Estimator owns it.
            model = build(conv_fn, pool_fn, jnp.dtype(dtype))
            logits = model(features, train=mode == ex.ModeKeys.TRAIN)
            return ex.EstimatorSpec(
                mode=mode,
                loss=ex.losses.softmax_cross_entropy(logits, labels),
                optimizer=optax.sgd(0.01, momentum=0.9),
            )

        def input_fn(params):
            while True:
                yield x, y

        self.input_fn = input_fn
        config = ex.RunConfig(
            model_dir=tempfile.mkdtemp(prefix="train_cpu_"),
            iterations_per_loop=10,
            save_checkpoints_secs=1e9,
            num_shards=1,
            log_step_count_steps=10**6,
            save_summary_steps=10**6,
        )
        self.est = ex.Estimator(model_fn, config, train_batch_size=self.batch)
        t0 = time.perf_counter()
        with native.native_kernels("xla" not in parts):  # traced (and compiled) here
            self.est.train(input_fn, max_steps=1)
        self.compile_s = time.perf_counter() - t0

    def images_per_sec(self, steps: int) -> float:
        from estimax import ops

        if self.tuned_malloc:
            ops.tune_cpu_allocator()
        else:
            ops.restore_cpu_allocator()
        t0 = time.perf_counter()
        self.est.train(self.input_fn, steps=steps)  # includes one checkpoint save at the end
        return steps * self.batch / (time.perf_counter() - t0)


# ============================================================================ driver


def _markdown(res: dict[str, Any]) -> str:
    variants = list(dict.fromkeys(v for cell in res["median"].values() for v in cell))
    best_jax = [v for v in variants if v != "torch"][-1:] or ["jax"]
    lines = [
        "# Training throughput on the CPU (train images/s, median of interleaved rounds)",
        "",
        res["note"],
        "",
        "| model, batch | dtype | "
        + " | ".join(variants)
        + f" | {best_jax[0]} / torch | {best_jax[0]} / jax |",
        "|---|---|" + "---|" * (len(variants) + 2),
    ]
    fmt = lambda v: f"{v:.2f}" if v is not None else "—"
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "—"
    for key, cell in res["median"].items():
        model, dtype = key.split("/")
        best = cell.get(best_jax[0])
        lines.append(
            f"| {model}, {BATCH[model]} | {dtype} | "
            + " | ".join(fmt(cell.get(v)) for v in variants)
            + f" | {ratio(best, cell.get('torch'))} | {ratio(best, cell.get('jax'))} |"
        )
    lines += [
        "",
        "Rounds (img/s): " + json.dumps(res["rounds"]),
        "",
        "Compile seconds (JAX): " + json.dumps(res["compile_s"]),
    ]
    return "\n".join(lines) + "\n"


_WORKER_PARTS = ("noynn", "onednn2")


def jax_worker() -> None:
    """Reads ``model dtype variant steps`` lines on stdin, answers ``{"img_s", "compile_s"}``."""
    runners: dict[tuple[str, str, str], JaxRunner] = {}
    for line in sys.stdin:
        model, dtype, variant, steps = line.split()
        key = (model, dtype, variant)
        compile_s = None
        if key not in runners:
            if any(k[0] != model for k in runners):
                runners.clear()  # one model at a time, as the parent does
            runners[key] = JaxRunner(model, dtype, variant)
            compile_s = runners[key].compile_s
        rate = runners[key].images_per_sec(int(steps))
        print(json.dumps({"img_s": rate, "compile_s": compile_s}), flush=True)


def _worker_env(part: str, onednn2_lib: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if part == "noynn":
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_cpu_experimental_ynn_fusion_type=".strip()
    elif part == "onednn2":
        if not onednn2_lib or not os.path.exists(onednn2_lib):
            sys.exit(
                "train_cpu.py: +onednn2 needs --onednn2_lib=PATH to a library of the old build"
            )
        env["ESTIMAX_ONEDNN_LIB"] = onednn2_lib
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mnist,resnet50")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default="jax,jax+ops+malloc+xla,jax+ops+malloc,torch")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds for MNIST")
    parser.add_argument(
        "--resnet_rounds",
        type=int,
        default=2,
        help="interleaved rounds for ResNet-50 (few: the CPU is shared)",
    )
    parser.add_argument("--mnist_steps", type=int, default=10)
    parser.add_argument("--resnet_steps", type=int, default=2)
    parser.add_argument("--harness", choices=("bare", "estimator"), default="bare")
    # The ISA cap is part of the result's section: oneDNN (estimax's and PyTorch's alike) reads
    # ONEDNN_MAX_CPU_ISA, so one machine can measure what an AVX2-only CPU gets.
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    parser.add_argument(
        "--out",
        default=None,
        help="a JSON file of its own (and .md beside it); default: this CPU's (and harness's, "
        "ISA cap's, dtype interleaving's) section of bench/results/train_cpu.{json,md}",
    )
    parser.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jax-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--onednn2_lib", default=None, help="the old build's library (+onednn2)")
    parser.add_argument(
        "--interleave_dtypes",
        action="store_true",
        help="time every dtype of a model in the same rounds (more memory; fairer fp32 vs bf16)",
    )
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    if args.torch_worker:
        torch_worker()
        return
    if args.jax_worker:
        jax_worker()
        return
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    variants = args.variants.split(",")
    for m in models:
        if m not in BATCH:
            sys.exit(f"train_cpu.py: --models entry {m!r} unknown; expected mnist or resnet50")
    worker = None
    if "torch" in variants:
        if not os.path.exists(TORCH_PY):
            sys.exit(
                f"train_cpu.py: {TORCH_PY} not found; create bench/.venv-torch with "
                "`pip install torch==2.13.0 numpy`, or drop torch from --variants"
            )
        worker = subprocess.Popen(
            [TORCH_PY, os.path.abspath(__file__), "--torch-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    jax_workers: dict[str, subprocess.Popen] = {}
    for v in variants:
        part = next((p for p in _WORKER_PARTS if p in v.split("+")), None)
        if part and part not in jax_workers:
            jax_workers[part] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--jax-worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=_worker_env(part, args.onednn2_lib),
            )
    worker_status: dict[str, str] = {}

    def worker_rate(variant: str, model: str, dtype: str, steps: int) -> float:
        part = next(p for p in _WORKER_PARTS if p in variant.split("+"))
        w = jax_workers[part]
        assert w.stdin is not None and w.stdout is not None
        w.stdin.write(f"{model} {dtype} {variant} {steps}\n")
        w.stdin.flush()
        answer = json.loads(w.stdout.readline())
        if answer["compile_s"] is not None:
            compile_s[f"{model}/{dtype}/{variant}"] = round(answer["compile_s"], 1)
        return answer["img_s"]

    def torch_rate(model: str, dtype: str, steps: int) -> float:
        assert worker is not None and worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(f"{model} {dtype} {steps}\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline())["img_s"]

    rounds: dict[str, dict[str, list[float]]] = {}
    compile_s: dict[str, float] = {}
    for model in models:
        steps = args.mnist_steps if model == "mnist" else args.resnet_steps
        # With --interleave_dtypes every (dtype, variant) of a model is built first and each
        # round times them all, so fp32 and bf16 meet the same load (the machine is shared).
        groups = [dtypes] if args.interleave_dtypes else [[d] for d in dtypes]
        for group in groups:
            runners = {}
            for dtype in group:
                key = f"{model}/{dtype}"
                for v in variants:
                    if v != "torch" and not any(p in v.split("+") for p in _WORKER_PARTS):
                        runner_cls = JaxRunner if args.harness == "bare" else EstimatorRunner
                        runners[(dtype, v)] = runner_cls(model, dtype, v)
                        compile_s[f"{key}/{v}"] = round(runners[(dtype, v)].compile_s, 1)
            for r in range(args.rounds if model == "mnist" else args.resnet_rounds):
                for dtype in group:
                    key = f"{model}/{dtype}"
                    for v in variants:  # interleaved: every variant once per round
                        if v == "torch":
                            rate = torch_rate(model, dtype, steps)
                        elif (dtype, v) not in runners:
                            rate = worker_rate(v, model, dtype, steps)
                        else:
                            rate = runners[(dtype, v)].images_per_sec(steps)
                        rounds.setdefault(key, {}).setdefault(v, []).append(round(rate, 3))
                        print(f"round {r} {key:20s} {v:8s} {rate:9.2f} img/s", flush=True)
            del runners
    if worker is not None:
        worker.stdin.close()  # type: ignore[union-attr]
        worker.wait()
    for part, w in jax_workers.items():
        w.stdin.close()  # type: ignore[union-attr]
        w.wait()
        if part == "onednn2":
            env = _worker_env(part, args.onednn2_lib)
            worker_status[part] = subprocess.run(
                [sys.executable, "-m", "estimax.ops.native", "status"],
                env=env, capture_output=True, text=True, check=False,
            ).stdout.strip()  # fmt: skip
    median = {k: {v: statistics.median(x) for v, x in d.items()} for k, d in rounds.items()}
    from estimax.ops import native  # noqa: PLC0415 - not in the PyTorch worker's environment

    res = {
        "note": (
            f"{os.cpu_count()} CPU cores ({native.cpu_model()}), ONEDNN_MAX_CPU_ISA="
            f"{isa_cap or 'unset'}; 1-minute load "
            f"average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (the "
            f"benchmark alone keeps it near 2; well above that, other processes shared the "
            f"cores); CPU convolutions: {native.status()}; "
            + "".join(f"+{p} worker: {st}; " for p, st in worker_status.items())
            + f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} (+noynn adds "
            f"--xla_cpu_experimental_ynn_fusion_type=); "
            f"harness={args.harness}; dtypes interleaved: {args.interleave_dtypes}; "
            f"{args.rounds} (MNIST) / "
            f"{args.resnet_rounds} (ResNet-50) interleaved rounds of {args.mnist_steps} / "
            f"{args.resnet_steps} steps; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
        ),
        "median": median,
        "rounds": rounds,
        "compile_s": compile_s,
    }
    md = _markdown(res)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(md)
    else:  # one file for every CPU kind: this run replaces its own section
        label = f"{cpu_kind()}, harness={args.harness}"
        label += f", ONEDNN_MAX_CPU_ISA={isa_cap}" if isa_cap else ""
        label += ", dtypes interleaved" if args.interleave_dtypes else ""
        report = md.replace("# Training throughput on the CPU", f"# {label}", 1)
        title = "Training throughput on the CPU (bench/train_cpu.py)"
        write_section("train_cpu", slug(label), report, res, title)
    print(md)


if __name__ == "__main__":
    main()
