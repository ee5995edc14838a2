"""Accelerator chips' published figures: memory, bandwidth and peak dense bf16 compute.

One table for everything that divides by a chip's capacity: ``--compile_for``'s fit verdict
and roofline (``estimax.compile.compile``) and a training run's model FLOPs utilisation.
Every figure carries the public page it comes from. A peak is the **dense** bf16 (or fp16)
tensor-core figure: NVIDIA's datasheets lead with the 2:4-sparsity figure (twice the dense
one) and list TF32 beside it, and taking either for the dense bf16 peak is the usual way an
MFU comes out wrong elsewhere; so each GPU entry says which datasheet figure it halved or took.

A device no entry names has no peak: callers say "unknown", they never guess.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One chip's published figures.

    Attributes:
      hbm_gib: device memory per chip (GiB, 2**30 bytes; NVIDIA's "80 GB" cards are 80 GiB
        less the driver's reserve, given here as the memory a process can see).
      hbm_gbps: memory bandwidth per chip (GB/s, 1e9 bytes).
      bf16_tflops: peak dense bfloat16 compute per chip (1e12 FLOP/s).
      source: the public page the figures come from.
      kinds: the ``device_kind`` strings JAX reports for this chip (for ``for_device``).
      note: how the peak was read off the source, where it needed reading.
    """

    hbm_gib: float
    hbm_gbps: float
    bf16_tflops: float
    source: str
    kinds: tuple[str, ...] = ()
    note: str = ""


# Per chip, as Google publishes them. A "device" of a topology is a TensorCore on v2/v3/v4 and
# TPU7x (two per chip: libtpu's v4:2x2x1 and tpu7x:2x2x1 have 8 devices, two to each chip's
# coordinates) and a chip on v5e/v5p/v6e; per-device figures divide by the devices per chip,
# counted from the topology itself.
TPU_CHIPS: dict[str, ChipSpec] = {
    # The v2 page links its figures to Jouppi et al., "A Domain-Specific Supercomputer for
    # Training Deep Neural Networks", CACM 63(7), 2020, Table 3: 46 TFLOPS, 16 GiB, 700 GB/s.
    "v2": ChipSpec(16, 700, 46, "https://cloud.google.com/tpu/docs/v2", ("TPU v2",)),
    "v3": ChipSpec(32, 900, 123, "https://cloud.google.com/tpu/docs/v3", ("TPU v3",)),
    "v4": ChipSpec(32, 1200, 275, "https://cloud.google.com/tpu/docs/v4", ("TPU v4",)),
    "v5e": ChipSpec(16, 819, 197, "https://cloud.google.com/tpu/docs/v5e", ("TPU v5 lite",)),
    "v5p": ChipSpec(95, 2765, 459, "https://cloud.google.com/tpu/docs/v5p", ("TPU v5", "TPU v5p")),
    "v6e": ChipSpec(32, 1638, 918, "https://cloud.google.com/tpu/docs/v6e", ("TPU v6 lite",)),
    # Ironwood. The page's table: 2,307 bf16 TFLOPs (4,614 is FP8), 192 GiB, 7,380 GB/s per
    # chip; two TensorCores per chip, each its own JAX device ("TPU7x", as libtpu 0.0.42.1's
    # tpu7x:2x2x1 names them).
    "tpu7x": ChipSpec(
        192, 7380, 2307, "https://cloud.google.com/tpu/docs/tpu7x", ("TPU7x", "TPU 7x")
    ),
}

# Per GPU (SXM boards where there are several), from NVIDIA's product pages and datasheets.
# Memory: the card's GB as GiB would overstate it; XLA's own target descriptions
# (xla/backends/gpu/target_config/specs/*.txtpb, device_memory_size) give what a process sees,
# e.g. 84,942,979,072 bytes (79.1 GiB) for the H100 SXM.
_HALVED = "the datasheet's bf16 figure is with 2:4 sparsity; this is half of it, the dense peak"
GPU_CHIPS: dict[str, ChipSpec] = {
    "h100": ChipSpec(
        79.1,
        3350,
        989.4,
        "https://www.nvidia.com/en-us/data-center/h100/",
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100"),
        _HALVED + " (1,979 TFLOPS sparse, SXM)",
    ),
    "h200": ChipSpec(
        # XLA's h200.txtpb: 151,397,597,184 bytes (141 GiB; "141 GB" is GiB here, as nvidia-smi
        # shows ~140 GiB); 131.3 (141e9 bytes) understated it.
        141.0,
        4800,
        989.4,
        "https://www.nvidia.com/en-us/data-center/h200/",
        ("NVIDIA H200", "NVIDIA H200 141GB HBM3e"),
        _HALVED + " (1,979 TFLOPS sparse, SXM; 141 GB)",
    ),
    "a100-80gb": ChipSpec(
        79.2,
        2039,
        312,
        "https://www.nvidia.com/en-us/data-center/a100/",
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
        "the datasheet's dense bf16 figure (624 TFLOPS is with sparsity)",
    ),
    "a100-40gb": ChipSpec(
        39.4,
        1555,
        312,
        "https://www.nvidia.com/en-us/data-center/a100/",
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
        "the datasheet's dense bf16 figure (624 TFLOPS is with sparsity)",
    ),
    "l4": ChipSpec(
        22.4,
        300,
        121,
        "https://www.nvidia.com/en-us/data-center/l4/",
        ("NVIDIA L4",),
        _HALVED + " (242 TFLOPS sparse; 24 GB GDDR6)",
    ),
    "b200": ChipSpec(
        # XLA's b200.txtpb: 191,514,411,008 bytes (178.4 GiB); 167.6 (180e9 bytes) understated it.
        178.4,
        8000,
        2250,
        "https://www.nvidia.com/en-us/data-center/hgx/",
        ("NVIDIA B200",),
        _HALVED + " (HGX B200, 4.5 PFLOPS sparse per GPU; 180 GB)",
    ),
    "gb200": ChipSpec(
        # XLA's gb200.txtpb: 197,897,748,480 bytes (184.3 GiB; NVIDIA's "186 GB" per GPU, half of
        # a superchip's 372 GB, as a process sees it). The page gives a Grace Blackwell
        # superchip (one Grace CPU, two GPUs): 10 PFLOPS FP16/BF16 sparse, 16 TB/s.
        184.3,
        8000,
        2500,
        "https://www.nvidia.com/en-us/data-center/gb200-nvl72/",
        ("NVIDIA GB200",),
        _HALVED + " (a superchip's 10 PFLOPS sparse over its two GPUs: 5 sparse, 2.5 dense "
        "PFLOPS per GPU; 16 TB/s over two: 8 TB/s)",
    ),
}


def for_device(device: Any) -> tuple[str, ChipSpec] | None:
    """The chip a JAX device is (its name and figures), by its ``device_kind``; None if no
    entry names it (a CPU, an unlisted card: the caller says so, it does not guess)."""
    kind = str(getattr(device, "device_kind", device)).strip()
    for table in (TPU_CHIPS, GPU_CHIPS):
        for name, chip in table.items():
            if kind in chip.kinds:
                return name, chip
    return None
