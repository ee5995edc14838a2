"""``--compile_for=h100:8``: every program's steps compiled for NVIDIA GPUs on a CPU-only host.

The tests that need XLA's GPU compiler (JAX's CUDA plugin and ptxas, the ``gpu-compile`` extra)
run in ``make test``'s ``.venv-cuda`` (``ESTIMAX_REQUIRE_CUDA=1``: they fail there instead of
skipping), with no ``JAX_PLATFORMS`` set, as a user runs them; in the default venv they skip,
and the ones that need no plugin run (names, counts, the descriptions' facts, the fit verdict,
and the lines a user sees without the plugin or with one that did not load).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import estimax as ex
from estimax.compile import compile as compile_lib
from estimax.compile import gpu_compile
from estimax.parallel import chips
from estimax.programs import common
from estimax.programs.configs import LoopConfig
from estimax.programs.job import Job
from tests.test_tpu_compile import (
    CPU_ONLY,
    REPO,
    TINY,
    _fatal_lines,
    dense_model_fn,
    run_program,
)

HAS_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None
if os.environ.get("ESTIMAX_REQUIRE_CUDA") and not HAS_PLUGIN:
    raise RuntimeError("ESTIMAX_REQUIRE_CUDA is set but JAX's CUDA plugin is not installed")
needs_plugin = pytest.mark.skipif(
    not HAS_PLUGIN,
    reason="needs JAX's CUDA plugin (the gpu-compile extra; make test runs these in .venv-cuda)",
)
# Four GPUs: batches below divide by 4 and by the 8 virtual CPU devices.
TARGET = "h100:4"
if HAS_PLUGIN:
    # What the programs do as they parse --compile_for=GPU (cli._keep_cuda_out), before anything
    # looks for devices; the in-process runs below start past that point (run_from_flags), and
    # without it JAX's CUDA plugin would fail its CUDA version check here and not load.
    gpu_compile.use_cpu_backend()


@needs_plugin
def test_the_documented_command_compiles_without_a_gpu_or_any_variable():
    """docs/accelerators.md's ``mnist --compile_for=h100:8 --batch_size=1024``, in a fresh
    process with no JAX_PLATFORMS: JAX's CUDA plugin once failed its version check there
    ("Unable to load CUDA. Is it installed?") and estimax asked for the extra just installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "ESTIMAX_"))}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "estimax.programs.mnist",
            "--compile_for=h100:8",
            "--batch_size=1024",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    for line, step in zip(lines, ("train", "eval"), strict=True):
        assert line.startswith(
            f"{step} step on NVIDIA H100 80GB HBM3 x8 (h100:8; global batch 1,024, f32): fits: "
        ), line
    assert "Unable to load CUDA" not in proc.stderr and "Traceback" not in proc.stderr


@needs_plugin
@pytest.mark.parametrize("program", sorted(TINY))
def test_every_program_compiles_for_gpus(program, monkeypatch, capsys):
    result, _ = run_program(program, [f"--compile_for={TARGET}"], monkeypatch)
    reports = result["compile_for"]
    assert [r["step"] for r in reports] == ["train", "eval"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    usable = 0.75 * 84_942_979_072 - 4 * 2**30  # JAX's 75% of an H100's, less cuDNN's 4 GiB
    for line, report in zip(lines, reports, strict=True):
        assert line.startswith(
            f"{report['step']} step on NVIDIA H100 80GB HBM3 x4 ({TARGET}; global batch 8, "
        )
        assert ": fits: " in line and " GiB usable (75% of 79.1 GiB less 4.0 GiB for cuDNN)" in line
        assert report["fits"] and report["global_batch"] == 8
        assert report["hbm_bytes"] == 84_942_979_072 and report["usable_bytes"] == usable
        assert 0 < report["memory_bytes"] < usable
        # The CPU client's cost analysis (the GPU executable has none).
        assert report["flops"] > 0 and report["bytes_accessed"] > 0
        assert report["peak_flops"] == 989.4e12 and report["hbm_bandwidth"] == 3350e9
        assert report["roofline_s"] > 0 and report["examples_per_s"] > 0
        assert not [t for t in report["custom_calls"] if CPU_ONLY.match(t)], report
    if program in ("mnist", "resnet"):  # convolutions: cuDNN's (forward ones may be fused
        # with their bias and activation: __cudnn$convBiasActivationForward), for the H100
        calls = reports[0]["custom_calls"]
        assert "__cudnn$convBackwardFilter" in calls, calls
        assert [c for c in calls if re.match(r"__cudnn\$conv(BiasActivation)?Forward$", c)], calls


@needs_plugin
def test_a_step_that_does_not_fit_a_gpu_still_compiles_and_the_search_finds_one_that_does(
    tmp_path,
):
    # 2**25 examples of 784 floats on 4 L4s: 24.5 GiB of input per GPU, more than the 12.9 GiB
    # usable there (75% of 22.5 GiB less 4 GiB), and XLA:GPU compiles it all the same.
    too_big = 2**25
    job = Job(
        program="dense",
        model_flags={},
        model_fn=dense_model_fn,
        config=ex.RunConfig(model_dir=str(tmp_path), num_shards=None),
        batch_sizes=(too_big, 8),
        input_fn=lambda is_training: None,
        loop=LoopConfig(mode="train", train_steps=1, steps_per_eval=1),
        serving=ex.TensorSpec((None, 784), np.float32),
        metrics=(("accuracy",), "examples"),
        compile_for="l4:4",
    )
    with pytest.raises(common.DoesNotFit) as raised:
        common.run(job)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(
        f"the train step does not fit on l4:4 at global batch {too_big:,}: "
    )
    report = raised.value.reports[0]
    # XLA:GPU compiled it: the sizes say by how much it is too big.
    assert not report.fits and report.memory_bytes > report.usable_bytes
    assert "XLA compiles it all the same" in report.error
    exact = re.search(
        r"the largest global batch that fits is ([\d,]+) \(([\d,]+) does not", message
    )
    bracket = re.search(r"a global batch of ([\d,]+) fits and ([\d,]+) does not", message)
    fits, fails = (int(g.replace(",", "")) for g in (exact or bracket).groups())
    assert fits % 4 == 0 and fits < fails < too_big
    # The input (784 float32 per example, a quarter of the batch per GPU) is about half of
    # what is usable at the batch found (measured: 6.86 of 13.8 GB; the temporaries hold about
    # as much again): the search went close to the limit.
    assert 0.4 * report.usable_bytes < fits / 4 * 784 * 4 <= report.usable_bytes


def test_unknown_gpu_and_malformed_count_are_one_line_listing_the_known_ones():
    for target, start in [
        ("x100:8", "unknown GPU 'x100:8': known are "),
        ("h100:eight", "malformed GPU count in 'h100:eight': "),
        ("h100:0", "malformed GPU count in 'h100:0': "),
    ]:
        (fatal,) = _fatal_lines("mnist", f"--compile_for={target}")
        assert fatal.startswith(f"FATAL: --compile_for={target}: {start}"), fatal
        for name in gpu_compile.KNOWN_GPUS:
            assert name in fatal
    with pytest.raises(compile_lib.CompileForError, match="give a multiple of 8"):
        compile_lib.check_topology("a100-80gb:12")
    assert compile_lib.check_topology("a100-80gb:16") == "a100-80gb"
    assert compile_lib.check_topology("v5e:2x4") == "v5e"  # TPU names keep their meaning


@pytest.mark.skipif(HAS_PLUGIN, reason="shows what a user without JAX's CUDA plugin sees")
def test_without_the_plugin_one_line_says_how_to_install_it():
    fatal = _fatal_lines("mnist", "--compile_for=h100:8")
    assert fatal == [
        "FATAL: --compile_for=h100:8: compiling for h100:8 needs XLA's GPU compiler (JAX's "
        f"CUDA plugin): {gpu_compile.GPU_INSTALL_HINT}."
    ]


def test_a_plugin_that_did_not_load_is_named_with_its_cause_not_an_install_hint(monkeypatch):
    """The plugin installed but not loaded: the line says so, with what JAX logged and what to
    change, never "pip install" the extra just installed."""
    # What JAX logs when a plugin's initialize() raises (xla_bridge.discover_pjrt_plugins).
    jax_log = logging.getLogger("jax._src.xla_bridge")
    monkeypatch.setattr(gpu_compile._PLUGIN_ERRORS, "causes", [])
    try:
        raise RuntimeError("Unable to load CUDA. Is it installed?")
    except RuntimeError:
        jax_log.exception("Jax plugin configuration error: Exception when calling %s", "x")
    assert gpu_compile._PLUGIN_ERRORS.causes == ["Unable to load CUDA. Is it installed?"]
    cause = gpu_compile._PLUGIN_ERRORS.causes[-1]
    plugin = "jax-cuda12-plugin 0.10.2"
    head = (
        "compiling for h100:8: JAX's CUDA plugin (jax-cuda12-plugin 0.10.2) is installed but did "
        "not load (Unable to load CUDA. Is it installed?): "
    )
    for platforms, fix in [
        ("cuda", "JAX_PLATFORMS=cuda asks JAX to start CUDA, which needs a GPU and its driver; "),
        (None, "JAX looked for its devices before estimax could keep CUDA out"),
        ("cpu", "reinstall the gpu-compile extra (the plugin's version must be jaxlib's, "),
    ]:
        line = str(gpu_compile.no_compiler("h100:8", plugin, cause, platforms))
        assert line.startswith(head + fix) and "\n" not in line, line
        assert "pip install" not in line
    missing = str(gpu_compile.no_compiler("h100:8", None, None, None))
    assert missing.endswith(f"(JAX's CUDA plugin): {gpu_compile.GPU_INSTALL_HINT}.")


def test_jax_platforms_naming_cuda_without_a_gpu_is_one_line_else_jax_stays_on_cpu(monkeypatch):
    kept: list[bool] = []
    monkeypatch.setattr(gpu_compile, "_gpu_visible", lambda: False)
    monkeypatch.setattr(gpu_compile, "use_cpu_backend", lambda: kept.append(True) or True)
    with pytest.raises(gpu_compile.GpuTargetError) as e:
        gpu_compile.keep_cuda_out("h100:8", platforms="cuda,cpu")
    assert str(e.value) == (
        "JAX_PLATFORMS=cuda,cpu asks JAX to start CUDA, which needs a GPU and its driver (this "
        "machine shows none); compiling for h100:8 needs neither: unset JAX_PLATFORMS."
    )
    assert kept == []
    gpu_compile.keep_cuda_out("h100:8", platforms="")
    monkeypatch.setattr(gpu_compile, "_gpu_visible", lambda: True)
    gpu_compile.keep_cuda_out("h100:8", platforms="cuda")  # a GPU here: JAX may start it
    assert kept == [True, True]


@pytest.mark.parametrize("gpu", gpu_compile.KNOWN_GPUS)
def test_each_gpu_has_a_cited_description_that_agrees_with_the_chip_table(gpu):
    text = gpu_compile.target_config(gpu)
    # Where each description comes from: XLA's file at a commit, or (the L4) each line's source.
    assert "https://github.com/openxla/xla/blob/" in text or re.search(r"# \[PG\]", text)
    assert not re.search(r"^\s*collective_memory_granularity:", text, re.M)  # jaxlib 0.10.2: no
    memory = gpu_compile.device_memory_bytes(gpu)
    assert abs(memory / 2**30 / chips.GPU_CHIPS[gpu].hbm_gib - 1) < 0.01, (gpu, memory)
    name = re.search(r'device_description_str: "([^"]+)"', text).group(1)
    assert chips.for_device(name) == (gpu, chips.GPU_CHIPS[gpu])


def test_the_gpu_fit_verdict_leaves_jax_its_fraction_and_cudnn_a_margin(monkeypatch):
    h100 = 84_942_979_072
    assert gpu_compile.fit_error(55 * 2**30, h100) is None  # 75% of 79.1 GiB - 4 = 55.3 GiB
    error = gpu_compile.fit_error(306.8 * 2**30, h100)
    # The batch search reads the first size as needed and the last as available.
    needed, available = compile_lib.oom_sizes(error)
    assert needed == 306.8 * 2**30 and abs(available / 2**30 - 55.33) < 0.01
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert gpu_compile.fit_error(70 * 2**30, h100) is None


def test_custom_calls_are_counted_by_their_operands_and_results():
    hlo = """
  %param.1 = bf16[8,32,32,16]{3,2,1,0} parameter(0)
  %w = bf16[32,3,3,16]{3,2,1,0} fusion(%param.1), kind=kLoop
  %cudnn-conv.1 = (bf16[8,32,32,32]{3,2,1,0}, u8[0]{0}) custom-call(%param.1, %w), window={size=3x3}, custom_call_target="__cudnn$convForward"
"""  # noqa: E501 (XLA's own line)
    assert gpu_compile.custom_call_bytes(hlo) == [
        (8 * 32 * 32 * 32 + 8 * 32 * 32 * 16 + 9 * 512) * 2
    ]
