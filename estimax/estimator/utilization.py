"""Model FLOPs utilisation (MFU): how much of the chip's peak a training run's steps use.

MFU per device = (the compiled train step's flops per device) / (measured seconds per step)
/ (the chip's dense bf16 peak per device). The training loop logs it with ``global_step/sec``
and writes it to TensorBoard as ``MFU`` (percent), beside the achieved ``TFLOP/s/device``,
which needs no peak and so is known on a CPU or an unlisted card too.

Where each figure comes from:

| figure                      | from                                           | when            |
|-----------------------------|------------------------------------------------|-----------------|
| flops per step, per device  | XLA's ``cost_analysis()`` of the executable    | once per        |
|                             | the loop runs (``jit.lower(args).compile()``:  | compiled step   |
|                             | jit's own cache, so nothing compiles twice)    |                 |
| seconds per step            | ``StepLogger``'s ``global_step/sec`` window    | every window    |
| peak per device             | ``chips.for_device`` (cited, dense bf16) over  | once            |
|                             | the devices per chip (2 TensorCores on v2/v3)  |                 |

Inside ``shard_map`` the compiled module is one device's program, so its flops are per device
already (8 CPU devices: 8 x per device = the unsharded step's count, tests/test_utilization.py).

What the count is and is not:
- XLA's cost analysis counts a loop's body once. A device loop of steps
  (``steps_per_device_call``) is therefore counted as one step, which is what we divide by; a
  train step's micro-batch loop (``gradient_accumulation_steps = k``) is multiplied by k where
  it is a loop (unrolled on CPU, where it is counted k times already); a loop inside the user's
  ``model_fn`` (a ``lax.scan`` over layers) is counted once, so such a model's MFU understates.
- The compiled flops are the work the chip does: with rematerialisation they include the
  recomputed forward passes (PaLM's "hardware FLOPs utilisation"), and the optimizer's update.
- A custom kernel's work is invisible to XLA (estimax's oneDNN convolutions on CPU, Pallas or
  Triton kernels): XLA counts such a call as no flops, so a step that holds one says "TFLOP/s
  and MFU unknown" and names the kernels, rather than report a fraction of its work (ResNet-50
  on CPU with oneDNN: 3.2 of ~200 GFLOP per step counted).
- The peak is the bf16 one whatever the step's dtypes: a float32 model's MFU is against a
  peak it cannot reach (as MaxText and torchtitan report theirs).
- The step time is the wall time of the window, compilation in the first one included.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from absl import logging

from estimax.parallel import chips

_CUSTOM_CALL = re.compile(r'custom_call @([\w.$-]+)|custom_call_target="([^"]+)"')


def custom_call_targets(text: str) -> tuple[str, ...]:
    """The custom-call targets named in StableHLO (``custom_call @t``) or HLO text, sorted."""
    return tuple(sorted({a or b for a, b in _CUSTOM_CALL.findall(text)}))


MFU_TAG = "MFU"
TFLOPS_TAG = "TFLOP/s/device"
# Custom-call targets that run math of their own, which XLA's cost analysis counts as none:
# estimax's FFI kernels (oneDNN convolutions), Pallas on TPU (Mosaic) and GPU, Triton kernels.
# Other targets (XLA's own bookkeeping, cuBLAS/cuDNN calls it does cost) are left alone.
UNCOUNTED_KERNELS = ("estimax_", "tpu_custom_call", "mosaic_gpu", "triton_kernel_call")


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's peak dense bf16 compute and where the figure comes from.

    Attributes:
      chip: the chip's name in ``chips`` (``v5e``, ``h100``).
      flops: FLOP/s per device (the chip's peak over ``devices_per_chip``).
      devices_per_chip: JAX devices sharing one chip (2 TensorCores on TPU v2/v3, else 1).
      source: the public page the chip's peak comes from.
    """

    chip: str
    flops: float
    devices_per_chip: int
    source: str

    def describe(self) -> str:
        """``"197 TFLOP/s per device (v5e's dense bf16 peak, https://...)"``."""
        shared = f" / {self.devices_per_chip} devices per chip" if self.devices_per_chip > 1 else ""
        return (
            f"{self.flops / 1e12:g} TFLOP/s per device ({self.chip}'s dense bf16 peak{shared}, "
            f"{self.source})"
        )


def devices_per_chip(devices: Sequence[Any]) -> int:
    """How many of ``devices`` share one chip, by their coordinates (TensorCores of a TPU v2/v3
    chip share them; a v4+ device or a GPU is a chip; devices without coordinates count 1)."""
    coords = {tuple(c) for c in (getattr(d, "coords", None) for d in devices) if c is not None}
    return max(1, len(devices) // len(coords)) if coords else 1


def peak_for(devices: Sequence[Any]) -> Peak | None:
    """The peak of ``devices`` (all of one kind), or None where ``chips`` cites none."""
    found = chips.for_device(devices[0])
    if found is None:
        return None
    name, chip = found
    per_chip = devices_per_chip(devices)
    return Peak(name, chip.bf16_tflops * 1e12 / per_chip, per_chip, chip.source)


def uncounted_kernels(compiled: Any) -> tuple[str, ...]:
    """The custom kernels in a compiled executable whose flops XLA cannot count."""
    return tuple(
        t for t in custom_call_targets(compiled.as_text()) if t.startswith(UNCOUNTED_KERNELS)
    )


def compiled_flops(compiled: Any) -> float | None:
    """The flops of one run of a compiled executable (per device), or None where the compiler
    gives no cost analysis (XLA:GPU gives none)."""
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):  # JaxRuntimeError is a RuntimeError
        return None
    cost = cost[0] if isinstance(cost, list) and cost else cost  # older jaxlibs: a list
    flops = cost.get("flops") if isinstance(cost, dict) else None
    return float(flops) if flops and flops > 0 else None


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One compiled train step's work per device, and the peak to divide it by.

    Attributes:
      flops: flops per step per device (None: the compiler gives no cost analysis, or the
        step holds kernels it cannot count).
      peak: the device's peak (None: no cited peak for it).
      kernels: the step's custom kernels XLA cannot count (then ``flops`` is None).
    """

    flops: float | None
    peak: Peak | None
    kernels: tuple[str, ...] = ()

    def rates(self, steps_per_sec: float) -> dict[str, float]:
        """The scalars known at ``steps_per_sec``: ``TFLOP/s/device`` and ``MFU`` (percent)."""
        if self.flops is None:
            return {}
        achieved = self.flops * steps_per_sec
        out = {TFLOPS_TAG: achieved / 1e12}
        if self.peak is not None:
            out[MFU_TAG] = 100 * achieved / self.peak.flops
        return out


def log_rates(rates: dict[str, float]) -> None:
    """Logs the rates beside the original's ``global_step/sec`` and ``examples/sec`` lines."""
    if TFLOPS_TAG in rates:
        logging.info("TFLOP/s per device: %g", rates[TFLOPS_TAG])
    if MFU_TAG in rates:
        logging.info("MFU: %.3g%%", rates[MFU_TAG])


class StepUtilization:
    """An Estimator's train steps' costs: each compiled step's flops read once, and each
    "MFU unknown" said once (not once per window, nor per ``train_and_evaluate`` segment).

    Args:
      devices: the mesh's devices (one kind).
      loop_multiplier: how many times the step runs a loop body XLA counts once (the
        micro-batches of gradient accumulation where they are a loop, k; else 1). The whole
        step's count is multiplied: the update after the loop, small beside it, k times too.
    """

    def __init__(self, devices: Sequence[Any], loop_multiplier: int = 1):
        self._kind = str(getattr(devices[0], "device_kind", devices[0]))
        self._peak = peak_for(devices)
        self._loops = loop_multiplier
        self._costs: dict[Any, StepCost] = {}
        self._said: set[str] = set()

    def cost(self, step_fn: Callable[..., Any], *args: Any) -> StepCost:
        """The cost of ``step_fn(*args)`` (a jitted step), about to be (or already) called.

        ``step_fn.lower(*args).compile()`` finds the executable in jit's cache (or puts it
        there for the call), so the step is compiled once either way; the result is kept per
        function and argument shapes, so a later run of the same step reads nothing again.
        """
        leaves, tree = jax.tree.flatten(args)
        key = (step_fn, tree, tuple(_signature(x) for x in leaves))
        if key not in self._costs:
            cost = self._measure(step_fn, args)
            self._costs[key] = cost
            self._say_once(cost)
        return self._costs[key]

    def _measure(self, step_fn: Callable[..., Any], args: tuple[Any, ...]) -> StepCost:
        lower = getattr(step_fn, "lower", None)
        if lower is None:  # not a jitted function: nothing to ask
            return StepCost(None, self._peak)
        compiled = lower(*args).compile()
        flops = compiled_flops(compiled)
        if flops is None:
            return StepCost(None, self._peak)
        kernels = uncounted_kernels(compiled)
        if kernels:
            return StepCost(None, self._peak, kernels)
        return StepCost(flops * self._loops, self._peak)

    def _say_once(self, cost: StepCost) -> None:
        if cost.kernels:
            self._once(
                "TFLOP/s and MFU unknown: XLA's cost analysis cannot count the work of the "
                f"step's custom kernels ({', '.join(cost.kernels)})"
            )
            return
        flops = cost.flops
        if flops is None:
            self._once("MFU unknown: the compiler gives no cost analysis")
            return
        peak = self._peak
        logging.info(
            "The compiled train step does %.4g GFLOP per device per step (XLA's cost analysis)%s.",
            flops / 1e9,
            "" if peak is None else f"; MFU is against {peak.describe()}",
        )
        if peak is None:
            self._once(
                f"MFU unknown: no peak for {self._kind} (estimax.parallel.chips cites the "
                "chips it knows); TFLOP/s per device is logged"
            )

    def _once(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            logging.info("%s", line)


def _signature(x: Any) -> Any:
    """What a compiled step depends on of one argument: shape, dtype, placement."""
    return (
        getattr(x, "shape", None),
        str(getattr(x, "dtype", type(x))),
        getattr(x, "sharding", None),
    )
