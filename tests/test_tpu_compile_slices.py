"""``--compile_for=v5e:2x4 --num_slices=2``: the MNIST program's steps compiled for two TPU
slices with no TPU (issue #50), and the report's DCN collectives.

Needs XLA's TPU compiler (libtpu): ``make test``'s libtpu phase runs this file in .venv-tpu
(``scripts/test_phases.py``); elsewhere the libtpu test skips and the HLO parsing tests run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from absl import flags

from estimax.compile import compile as compile_lib
from estimax.programs import mnist

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
if os.environ.get("ESTIMAX_REQUIRE_LIBTPU") and not HAS_LIBTPU:
    raise RuntimeError("ESTIMAX_REQUIRE_LIBTPU is set but libtpu is not installed")
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="needs libtpu (the tpu extra; make test runs these in .venv-tpu)"
)


@needs_libtpu
def test_two_tpu_slices_compile_with_no_tpu_and_the_report_names_them_and_their_dcn_traffic(
    capsys,
):
    fv = flags.FlagValues()
    mnist.define_flags(fv)
    # 16 chips in two v5e:2x4 slices; the batch divides over their 16 replicas.
    fv(["mnist", "--batch_size=16", "--eval_steps=1", "--compile_for=v5e:2x4", "--num_slices=2"])
    reports = mnist.run_from_flags(fv)["compile_for"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert [r["step"] for r in reports] == ["train", "eval"]
    for line, report in zip(lines, reports, strict=True):
        assert report["fits"] and report["num_devices"] == 16
        assert report["layout"] == "--num_slices=2"
        assert list(report["slices"]) == ["slice 0: devices 0-7 (8)", "slice 1: devices 8-15 (8)"]
        assert "; 2 slices (slice 0: devices 0-7 (8), slice 1: devices 8-15 (8)), over DCN: " in (
            line
        )
    train = reports[0]
    # XLA:TPU compiles each slice's program with the gradient's all-reduce over the slice's 8
    # devices (ICI); what crosses DCN is handed to the Megascale runtime: the slice-reduced
    # gradient, once a step (the dense layer's 3136 x 128 kernel is in it, whole).
    assert train["collectives"]["all-reduce"][0] >= 1
    count, nbytes = train["dcn_collectives"]["all-reduce"]
    assert count >= 1 and nbytes >= 3136 * 128 * 4, train["dcn_collectives"]
    assert f"over DCN: {count} all-reduce (" in lines[0]
    # No parameters are gathered across slices (nothing is split over DCN).
    assert "all-gather" not in train["dcn_collectives"]


def test_replica_groups_in_both_hlo_forms_and_which_cross_slices():
    assert compile_lib.replica_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert compile_lib.replica_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert compile_lib.replica_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert compile_lib.replica_groups("{}") == []
    slice_of = [0, 0, 0, 0, 1, 1, 1, 1]
    hlo = "\n".join(
        [
            "  %a = f32[10]{0} all-reduce(f32[10]{0} %x), replica_groups=[2,4]<=[8], to_apply=%s",
            "  %b = f32[10]{0} all-reduce(f32[10]{0} %a), replica_groups=[4,2]<=[2,4]T(1,0), "
            "to_apply=%s",
            "  %c = f32[3]{0} collective-permute(f32[3]{0} %x), source_target_pairs={{0,1},{4,5}}",
            "  %d = f32[3]{0} collective-permute(f32[3]{0} %x), source_target_pairs={{3,4}}",
            "  %e = f32[2]{0} all-reduce(f32[2]{0} %x), replica_groups={}, to_apply=%s",
            # XLA:TPU's multi-slice form: the DCN part handed to the Megascale runtime.
            "  %send = (f32[3,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%b, %after-all), "
            "channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_"
            'handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",'
            '_xla_megascale_transfer_type="ALL_REDUCE"}',
        ]
    )
    assert compile_lib.collectives(hlo) == {"all-reduce": [3, 88], "collective-permute": [2, 24]}
    assert compile_lib.collectives(hlo, slice_of) == {
        "all-reduce": [3, 48 + 3 * 8 * 128 * 4],
        "collective-permute": [1, 12],
    }
    assert compile_lib.slice_names(slice_of) == (
        "slice 0: devices 0-3 (4)",
        "slice 1: devices 4-7 (4)",
    )
