"""The chip table: every figure cited, dense peaks, and devices found by their kind."""

import jax
import pytest

from estimax.parallel import chips


@pytest.mark.parametrize("name,chip", [*chips.TPU_CHIPS.items(), *chips.GPU_CHIPS.items()])
def test_every_chip_is_cited_and_named_by_the_kinds_jax_reports(name, chip):
    assert chip.source.startswith("https://"), name
    assert chip.hbm_gib > 0 and chip.hbm_gbps > 0 and chip.bf16_tflops > 0
    assert chip.kinds, f"{name}: no device_kind maps to it"
    for kind in chip.kinds:
        assert chips.for_device(kind) == (name, chip)


def test_gpu_peaks_are_the_dense_ones():
    # The datasheets' leading bf16 figures are sparse: the H100's 1,979 TFLOPS taken as its
    # peak would halve every MFU. Each note says how the dense figure was read.
    assert chips.GPU_CHIPS["h100"].bf16_tflops < 1000
    for name, chip in chips.GPU_CHIPS.items():
        assert "dense" in chip.note, name


def test_a_cpu_has_no_peak():
    assert chips.for_device(jax.devices("cpu")[0]) is None
    assert chips.for_device("NVIDIA GeForce RTX 9999") is None


def test_the_newest_chips_have_their_published_figures_so_mfu_is_known():
    """Issue #51: TPU7x (Ironwood) and GB200 read "unknown" before they were in the table."""
    ironwood = chips.TPU_CHIPS["tpu7x"]
    assert (ironwood.bf16_tflops, ironwood.hbm_gib, ironwood.hbm_gbps) == (2307, 192, 7380)
    assert chips.for_device("TPU7x") == ("tpu7x", ironwood)
    gb200 = chips.GPU_CHIPS["gb200"]
    assert (gb200.bf16_tflops, gb200.hbm_gbps) == (2500, 8000)  # dense: half of 5 PFLOPS sparse
    assert chips.for_device("NVIDIA GB200") == ("gb200", gb200)


def test_ironwood_peaks_are_per_tensorcore_two_devices_to_a_chip():
    """A TPU7x chip is two JAX devices (libtpu's tpu7x:2x2x1: 8 devices on 4 chips' coords), so
    the MFU's peak per device is half the chip's 2,307 TFLOP/s."""
    from estimax.estimator import utilization

    class Core:
        device_kind = "TPU7x"

        def __init__(self, coords):
            self.coords = coords

    cores = [Core((x, y, 0)) for x in range(2) for y in range(2) for _ in range(2)]
    peak = utilization.peak_for(cores)
    assert peak is not None
    assert (peak.chip, peak.devices_per_chip, peak.flops) == ("tpu7x", 2, 2307e12 / 2)
