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
