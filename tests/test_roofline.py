"""The step-time model's arithmetic on HLO written here (no compiles): a fusion's bytes and
FLOPs, a loop's trip count, in-place updates and slices, a host transfer hidden behind compute,
a collective's wire bytes; the calibration's cache and override."""

from __future__ import annotations

import json
import os
import re

import pytest

from remat_kit import targets
from remat_kit.memory import calibration, hlo, roofline
from remat_kit.memory import kernels as K

MIB = 2**20

#: A fusion computing tanh(x) * y + x over [1024, 1024] f32, then a [1024, 1024] x [1024, 512]
#: matmul, in a loop of 4 iterations.
LOOP_MODULE = """
HloModule step, is_scheduled=true

%fused_elementwise (param_0: f32[1024,1024], param_1: f32[1024,1024]) -> f32[1024,1024] {
  %param_0 = f32[1024,1024]{1,0} parameter(0)
  %param_1 = f32[1024,1024]{1,0} parameter(1)
  %tanh.1 = f32[1024,1024]{1,0} tanh(%param_0)
  %multiply.1 = f32[1024,1024]{1,0} multiply(%tanh.1, %param_1)
  ROOT %add.1 = f32[1024,1024]{1,0} add(%multiply.1, %param_0)
}

%body (state: (s32[], f32[1024,1024], f32[1024,1024], f32[1024,512])) -> (s32[], f32[1024,1024], f32[1024,1024], f32[1024,512]) {
  %state = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, f32[1024,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[1024,1024]{1,0} get-tuple-element(%state), index=1
  %y = f32[1024,1024]{1,0} get-tuple-element(%state), index=2
  %w = f32[1024,512]{1,0} get-tuple-element(%state), index=3
  %fusion.1 = f32[1024,1024]{1,0} fusion(%x, %y), kind=kLoop, calls=%fused_elementwise
  %dot.1 = f32[1024,512]{1,0} dot(%fusion.1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple.1 = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, f32[1024,512]{1,0}) tuple(%i, %fusion.1, %y, %dot.1)
}

%cond (state.1: (s32[], f32[1024,1024], f32[1024,1024], f32[1024,512])) -> pred[] {
  %state.1 = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, f32[1024,512]{1,0}) parameter(0)
  ROOT %constant.9 = pred[] constant(true)
}

ENTRY %main (p0: (s32[], f32[1024,1024], f32[1024,1024], f32[1024,512])) -> (s32[], f32[1024,1024], f32[1024,1024], f32[1024,512]) {
  %p0 = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, f32[1024,512]{1,0}) parameter(0)
  ROOT %while.1 = (s32[], f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, f32[1024,512]{1,0}) while(%p0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""

#: A scan stacking a [4, 256] slice per step into a [16, 4, 256] buffer in place, and reading
#: one [1, 4, 256] slice of another [16, 4, 256] buffer.
SLICE_MODULE = """
HloModule slices, is_scheduled=true

%fused_dus (param_0.1: f32[16,4,256], param_1.1: f32[1,4,256], param_2.1: s32[]) -> f32[16,4,256] {
  %param_0.1 = f32[16,4,256]{2,1,0} parameter(0)
  %param_1.1 = f32[1,4,256]{2,1,0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[16,4,256]{2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %constant.1, %constant.1)
}

%fused_ds (param_0.2: f32[16,4,256], param_1.2: s32[]) -> f32[1,4,256] {
  %param_0.2 = f32[16,4,256]{2,1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %constant.2 = s32[] constant(0)
  %dynamic-slice.1 = f32[1,4,256]{2,1,0} dynamic-slice(%param_0.2, %param_1.2, %constant.2, %constant.2), dynamic_slice_sizes={1,4,256}
  ROOT %negate.1 = f32[1,4,256]{2,1,0} negate(%dynamic-slice.1)
}

ENTRY %main (stack: f32[16,4,256], src: f32[16,4,256], i: s32[]) -> f32[16,4,256] {
  %stack = f32[16,4,256]{2,1,0} parameter(0)
  %src = f32[16,4,256]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %fusion.ds = f32[1,4,256]{2,1,0} fusion(%src, %i), kind=kLoop, calls=%fused_ds
  ROOT %fusion.dus = f32[16,4,256]{2,1,0} fusion(%stack, %fusion.ds, %i), kind=kLoop, calls=%fused_dus
}
"""

#: 64 MiB offloaded to host (S(5)) while a [2048, 2048] x [2048, 2048] bf16 matmul runs, and
#: an all-reduce of 32 MiB over 4 devices.
TRANSFER_MODULE = """
HloModule transfers, is_scheduled=true

ENTRY %main (x: bf16[32,1024,1024], a: bf16[2048,2048], g: f32[8,1024,1024]) -> (bf16[32,1024,1024], bf16[2048,2048], f32[8,1024,1024]) {
  %x = bf16[32,1024,1024]{2,1,0} parameter(0)
  %a = bf16[2048,2048]{1,0} parameter(1)
  %g = f32[8,1024,1024]{2,1,0} parameter(2)
  %copy-start.1 = (bf16[32,1024,1024]{2,1,0:S(5)}, bf16[32,1024,1024]{2,1,0}, u32[]) copy-start(%x)
  %dot.2 = bf16[2048,2048]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy-done.1 = bf16[32,1024,1024]{2,1,0:S(5)} copy-done(%copy-start.1)
  %all-reduce.1 = f32[8,1024,1024]{2,1,0} all-reduce(%g), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %tuple.2 = (bf16[32,1024,1024]{2,1,0:S(5)}, bf16[2048,2048]{1,0}, f32[8,1024,1024]{2,1,0}) tuple(%copy-done.1, %dot.2, %all-reduce.1)
}
"""

FIGURES = calibration.DeviceFigures(
    name="test device",
    peak_flops={"f32": 1e12, "bf16": 4e12},
    memory_bytes_per_s=1e11,
    cache_bytes=0,
    cache_bytes_per_s=1e12,
    elementwise_per_s=1e12,
    transcendental_per_s=5e9,
    launch_s=1e-5,
    host_link_bytes_per_s=1e10,
    interconnect_bytes_per_s=1e11,
    source="written in the test",
)


def _kernels(text: str) -> dict[str, K.Kernel]:
    return {k.name: k for k in K.executed_kernels(hlo.parse_hlo_module(text))}


def test_fusion_bytes_flops_and_loop_trip_count():
    kernels = _kernels(LOOP_MODULE)
    assert set(kernels) == {"fusion.1", "dot.1"}
    fusion, dot = kernels["fusion.1"], kernels["dot.1"]
    assert fusion.count == dot.count == 4  # the loop body, 4 trips
    assert fusion.bytes_read == 2 * 4 * MIB and fusion.bytes_written == 4 * MIB
    assert fusion.transcendental == 1024 * 1024  # tanh
    assert fusion.elementwise == 2 * 1024 * 1024  # multiply, add
    assert fusion.flops == 0 and fusion.kind == "fusion"
    assert dot.flops == 2 * 1024 * 512 * 1024 and dot.dtype == "f32" and dot.kind == "matmul"
    assert dot.bytes_read == 4 * MIB + 2 * MIB and dot.bytes_written == 2 * MIB

    step = roofline.estimate(hlo.parse_hlo_module(LOOP_MODULE), FIGURES)
    # fusion: max(12 MiB / 1e11, 2M elementwise / 1e12 + 1M tanh / 5e9) -> tanh-bound
    fusion_s = max(12 * MIB / 1e11, 2 * 2**20 / 1e12 + 2**20 / 5e9)
    assert fusion_s > 12 * MIB / 1e11
    # dot: max(1.07 GFLOP / 1e12 f32 peak, 8 MiB / 1e11) -> compute-bound
    dot_s = max(2 * 1024 * 512 * 1024 / 1e12, 8 * MIB / 1e11)
    assert step.step_time_s == pytest.approx(4 * (fusion_s + dot_s + 2 * 1e-5))
    assert step.elementwise_s == pytest.approx(4 * fusion_s)
    assert step.compute_s == pytest.approx(4 * dot_s)
    assert step.launch_s == pytest.approx(8e-5) and step.kernels == 8
    assert step.top[0].name == "dot.1" and step.top[0].bound == "compute"


#: Attention's scores as XLA:CPU fuses them (a batched dot over [batch, heads] inside a
#: fusion, scaled), then the output projection as a plain dot, and a cuBLAS batched gemm call.
BATCHED_MODULE = """
HloModule batched, is_scheduled=true

%fused_scores (param_0: f32[4,6,256,64], param_1: f32[4,6,64,256]) -> f32[4,6,256,256] {
  %param_0 = f32[4,6,256,64]{3,2,1,0} parameter(0)
  %param_1 = f32[4,6,64,256]{3,2,1,0} parameter(1)
  %dot.3 = f32[4,6,256,256]{3,2,1,0} dot(%param_0, %param_1), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, rhs_contracting_dims={2}
  %constant.3 = f32[] constant(0.125)
  %broadcast.3 = f32[4,6,256,256]{3,2,1,0} broadcast(%constant.3), dimensions={}
  ROOT %multiply.3 = f32[4,6,256,256]{3,2,1,0} multiply(%dot.3, %broadcast.3)
}

ENTRY %main (q: f32[4,6,256,64], k: f32[4,6,64,256], x: f32[1024,384], w: f32[384,384], a: bf16[24,256,64], b: bf16[24,64,256]) -> (f32[4,6,256,256], f32[1024,384], bf16[24,256,256]) {
  %q = f32[4,6,256,64]{3,2,1,0} parameter(0)
  %k = f32[4,6,64,256]{3,2,1,0} parameter(1)
  %x = f32[1024,384]{1,0} parameter(2)
  %w = f32[384,384]{1,0} parameter(3)
  %a = bf16[24,256,64]{2,1,0} parameter(4)
  %b = bf16[24,64,256]{2,1,0} parameter(5)
  %fusion.scores = f32[4,6,256,256]{3,2,1,0} fusion(%q, %k), kind=kOutput, calls=%fused_scores
  %dot.out = f32[1024,384]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gemm.1 = bf16[24,256,256]{2,1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
  ROOT %tuple.3 = (f32[4,6,256,256]{3,2,1,0}, f32[1024,384]{1,0}, bf16[24,256,256]{2,1,0}) tuple(%fusion.scores, %dot.out, %gemm.1)
}
"""


def test_batched_matmuls_are_timed_at_the_batched_rate():
    """A dot with batch dimensions (attention's per-head matmuls) runs at the device's batched
    matmul rate where one is known (a CPU's calibration), the rest at the matmul peak."""
    kernels = _kernels(BATCHED_MODULE)
    scores, out, gemm = kernels["fusion.scores"], kernels["dot.out"], kernels["gemm.1"]
    scores_flops = 2 * 4 * 6 * 256 * 256 * 64
    assert scores.flops == scores.batched_flops == scores_flops and scores.kind == "matmul"
    assert out.flops == 2 * 1024 * 384 * 384 and out.batched_flops == 0
    assert gemm.flops == gemm.batched_flops == 2 * 24 * 256 * 256 * 64 and gemm.dtype == "bf16"

    comps = hlo.parse_hlo_module(BATCHED_MODULE)
    plain = roofline.estimate(comps, FIGURES)  # no batched figure: every matmul at the peak
    assert plain.compute_s == pytest.approx((scores_flops + out.flops) / 1e12 + gemm.flops / 4e12)
    slow = calibration.DeviceFigures(
        **{**FIGURES.__dict__, "batched_flops": {"f32": 1e11, "bf16": 2e11}}
    )
    step = roofline.estimate(comps, slow)
    assert step.compute_s == pytest.approx(
        scores_flops / 1e11 + out.flops / 1e12 + gemm.flops / 2e11
    )
    assert step.top[0].name == "fusion.scores" and step.top[0].bound == "compute"


def test_in_place_update_and_slice_count_what_they_touch():
    kernels = _kernels(SLICE_MODULE)
    ds, dus = kernels["fusion.ds"], kernels["fusion.dus"]
    one = 4 * 256 * 4  # bytes of one [1, 4, 256] f32 slice
    # the slice fusion reads its slice (and the 4-byte index), not the [16, 4, 256] buffer
    assert ds.bytes_read == one + 4 and ds.bytes_written == one
    # the in-place update writes its slice into the stacked buffer, which it does not read
    assert dus.bytes_written == one and dus.bytes_read == one + 4


def test_host_transfer_hides_behind_compute_and_collective_wire_bytes():
    kernels = _kernels(TRANSFER_MODULE)
    start = kernels["copy-start.1"]
    assert start.kind == "host_transfer" and start.async_start == "copy-start.1"
    assert start.bytes_written == 64 * MIB  # the array moved once, not the whole tuple
    reduce = kernels["all-reduce.1"]
    assert reduce.kind == "collective"
    assert reduce.bytes_read == int(32 * MIB * 2 * 3 / 4)  # ring all-reduce over 4 devices

    step = roofline.estimate(hlo.parse_hlo_module(TRANSFER_MODULE), FIGURES)
    link_s = 64 * MIB / 1e10
    dot_s = 2 * 2048**3 / 4e12 + 1e-5  # bf16 peak, plus launch
    assert step.transfer_s == pytest.approx(link_s - dot_s)  # the rest hid behind the dot
    assert step.collective_s == pytest.approx(2 * 3 / 4 * 32 * MIB / 1e11)
    assert step.step_time_s == pytest.approx(dot_s + (link_s - dot_s) + step.collective_s)


def test_allocation_term_only_where_the_backend_allocates_per_step():
    comps = hlo.parse_hlo_module(LOOP_MODULE)
    plain = roofline.estimate(comps, FIGURES, fresh_bytes=10**9)
    assert plain.allocation_s == 0.0
    cpu_like = calibration.DeviceFigures(**{**FIGURES.__dict__, "fresh_bytes_per_s": 1e9})
    fresh = roofline.estimate(comps, cpu_like, fresh_bytes=10**9)
    assert fresh.allocation_s == pytest.approx(1.0)
    assert fresh.step_time_s == pytest.approx(plain.step_time_s + 1.0)


@pytest.mark.parametrize(
    ("temp", "output", "alias", "fresh"),
    [
        (64 * MIB, 128 * MIB, 128 * MIB, 64 * MIB),  # donated state: the temp buffer only
        (31 * MIB, 0, 0, 0),  # below glibc's mmap ceiling: reused from the heap
        (40 * MIB, 100 * MIB, 20 * MIB, 120 * MIB),  # new outputs not aliased count too
        (40 * MIB, 50 * MIB, 20 * MIB, 40 * MIB),  # 30 MiB of new outputs: below the ceiling
        (None, None, None, 0),  # unknown parts: nothing priced
    ],
)
def test_fresh_bytes_counts_what_a_step_allocates_anew(temp, output, alias, fresh):
    parts = {"temp_bytes": temp, "output_bytes": output, "alias_bytes": alias}
    assert roofline.fresh_bytes(parts) == fresh


def test_reuse_model_serves_recent_values_from_the_cache():
    """The dot reads the fusion's output right after it is written: from the cache when the
    cache holds it, from memory when it is off."""
    comps = hlo.parse_hlo_module(LOOP_MODULE)
    cached = calibration.DeviceFigures(**{**FIGURES.__dict__, "cache_bytes": 64 * MIB})
    kernels = K.executed_kernels(comps)
    model = roofline._ReuseModel(cached.cache_bytes)
    hits = [model.split(k) for k in kernels]
    assert hits[0] == (0, 12 * MIB)  # the loop's inputs: never seen before
    assert hits[1][0] == 4 * MIB  # the fusion's output, just written
    assert roofline._ReuseModel(0).split(kernels[1]) == (0, 8 * MIB)


def test_step_time_round_trips_through_a_report_dict():
    step = roofline.estimate(hlo.parse_hlo_module(LOOP_MODULE), FIGURES)
    assert roofline.StepTime.from_dict(json.loads(json.dumps(step.to_dict()))) == step
    assert step.summary() == "5.22 ms (compute 82%, elementwise 16%, launch 2%)"


def test_calibration_is_cached_per_machine_and_can_be_given(tmp_path, monkeypatch):
    calls = []
    fake = {
        "peak_flops_f32": 1e11, "peak_flops_bf16": 5e10, "memory_bytes_per_s": 2e10,
        "fresh_bytes_per_s": 1e9, "launch_s": 1e-6, "cache_bytes_per_s": 1e11,
        "elementwise_per_s": 5e10, "transcendental_per_s": 5e9, "cache_bytes": 2**25,
    }  # fmt: skip
    monkeypatch.setattr(calibration, "measure", lambda runs=5: calls.append(runs) or dict(fake))
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibration.CALIBRATION_ENV, raising=False)
    first = calibration.calibrate()
    again = calibration.calibrate()
    assert len(calls) == 1 and first == again and first.measured
    assert first.peak_flops == {"f32": 1e11, "bf16": 5e10} and first.fresh_bytes_per_s == 1e9
    assert first.batched_flops is None  # a figures file from before the batched micro-kernel
    # when and at what load it was timed: one taken on a busy machine misprices memory traffic
    assert re.search(r"calibrated on this machine \d{4}-\d\d-\d\d \d\d:\d\d UTC, other "
                     r"processes \d+% of the cores, load average \d+\.\d\d ",
                     first.source), first.source  # fmt: skip
    calibration.calibrate(refresh=True)
    assert len(calls) == 2
    given = tmp_path / "fixed.json"
    batched = {"batched_flops_f32": 4e10, "batched_flops_bf16": 2e10}
    given.write_text(json.dumps({"figures": {**fake, **batched, "peak_flops_f32": 3e11}}))
    monkeypatch.setenv(calibration.CALIBRATION_ENV, str(given))
    read = calibration.calibrate()
    assert read.peak_flops["f32"] == 3e11 and len(calls) == 2
    assert read.batched_flops == {"f32": 4e10, "bf16": 2e10}


def test_a_calibration_timed_beside_other_work_is_timed_again_and_the_quieter_kept(
    tmp_path, monkeypatch
):
    """A newcomer's sweep reused a calibration another job had timed beside other work (load
    average 4.54 on 2 cores): its low rates put every estimate 27-179% above the measured steps,
    silently, for good. Now the share of the cores other processes used is recorded; a
    contended calibration says so and is timed again once RETIME_AFTER_S has passed, the
    quieter kept, and a file from before the share was recorded counts as contended when its
    load average exceeded the cores."""
    fake = {
        "peak_flops_f32": 1e11, "peak_flops_bf16": 5e10, "memory_bytes_per_s": 2e10,
        "fresh_bytes_per_s": 1e9, "launch_s": 1e-6, "cache_bytes_per_s": 1e11,
        "elementwise_per_s": 5e10, "transcendental_per_s": 5e9, "cache_bytes": 2**25,
    }  # fmt: skip
    shares, rates = [0.6, 0.7, 0.05], [1e11, 2e11, 3e11]  # per timing: others' share, GEMM rate

    def timed(fn):
        fn()
        return {**fake, "peak_flops_f32": rates.pop(0)}, shares.pop(0)

    monkeypatch.setattr(calibration, "others_share", timed)
    monkeypatch.setattr(calibration, "measure", lambda runs=5: None)
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibration.CALIBRATION_ENV, raising=False)
    first = calibration.calibrate()
    assert "other processes 60% of the cores" in first.source and "contended" in first.source
    assert calibration.calibrate().peak_flops["f32"] == 1e11 and len(shares) == 2  # too soon
    (path,) = (tmp_path / "calibration").glob("*.json")

    def age(seconds):
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "timed_at": data["timed_at"] - seconds}))

    age(calibration.RETIME_AFTER_S)
    kept = calibration.calibrate()  # timed again at 70%: no quieter, the first figures stay
    assert kept.peak_flops["f32"] == 1e11 and len(shares) == 1
    assert calibration.calibrate().peak_flops["f32"] == 1e11 and len(shares) == 1  # waits again
    age(calibration.RETIME_AFTER_S)
    quiet = calibration.calibrate()  # 5%: the quieter figures replace them
    assert quiet.peak_flops["f32"] == 3e11 and "contended" not in quiet.source and not shares
    assert quiet.calibration == calibration.Calibration(0.05, quiet.calibration.load_average, False)
    assert first.calibration.contended and first.calibration.others_share == 0.6
    # a file whose share could not be read: its load average against the cores
    data = json.loads(path.read_text())
    cores = int(data["key"]["cpu_count"])
    old = {k: v for k, v in data.items() if k not in ("others_share", "timed_at")}
    for load, contended in ((cores + 2.5, True), (cores * 0.5, False)):
        path.write_text(json.dumps({**old, "load_average": load}))
        shares[:], rates[:] = [0.0], [4e11]
        got = calibration.calibrate()
        assert (got.peak_flops["f32"] == 4e11) is contended and bool(shares) is not contended


def test_a_pinned_calibration_prices_a_whole_run_with_one_set_of_figures(tmp_path, monkeypatch):
    """A sweep's rows were priced with figures 5x apart: the contended calibration was timed
    again mid-sweep. Within pinned_calibration every calibration (of this process and of the
    workers it starts) reads the pinned file; a resumed run keeps the file it started with."""
    fake = {
        "peak_flops_f32": 1e11, "peak_flops_bf16": 5e10, "memory_bytes_per_s": 2e10,
        "fresh_bytes_per_s": 1e9, "launch_s": 1e-6, "cache_bytes_per_s": 1e11,
        "elementwise_per_s": 5e10, "transcendental_per_s": 5e9, "cache_bytes": 2**25,
    }  # fmt: skip
    rates, shares = [1e11, 2e11, 3e11], [0.9, 0.5, 0.4]  # each timing quieter than the last
    monkeypatch.setattr(calibration, "others_share",
                        lambda fn: ({**fake, "peak_flops_f32": rates.pop(0)}, shares.pop(0)))  # fmt: skip
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.CALIBRATION_ENV, raising=False)
    pin = tmp_path / "run.calibration.json"
    with calibration.pinned_calibration(pin):
        assert os.environ[calibration.CALIBRATION_ENV] == str(pin)
        (cached,) = (tmp_path / "cache" / "calibration").glob("*.json")
        data = json.loads(cached.read_text())  # contended and old: outside a pin, timed again
        cached.write_text(
            json.dumps({**data, "timed_at": data["timed_at"] - calibration.RETIME_AFTER_S})
        )
        seen = {calibration.calibrate().peak_flops["f32"] for _ in range(3)}
        assert seen == {1e11} and len(rates) == 2
    assert calibration.CALIBRATION_ENV not in os.environ
    assert calibration.calibrate().peak_flops["f32"] == 2e11 and len(rates) == 1  # re-timed outside
    with calibration.pinned_calibration(pin):  # resumed: the figures the run started with
        kept = calibration.calibrate()
        assert kept.peak_flops["f32"] == 1e11
        # said as the run's own copy, not as a file the user named
        assert f"kept for this run in {pin}" in kept.source and "$REMAT" not in kept.source
    other = tmp_path / "other.calibration.json"
    with calibration.pinned_calibration(other):  # a new run: the cached calibration of now
        assert calibration.calibrate().peak_flops["f32"] == 2e11 and len(rates) == 1


def test_threads_calibrating_at_once_time_the_machine_once(tmp_path, monkeypatch):
    """Compile workers reading their estimates on an empty cache each calibrated, and each wrote
    the same temporary file (named by the process id): one thread's rename removed the file
    another was renaming (FileNotFoundError on a new user's first analyze). Now one thread
    times the machine while the others wait, then read its figures."""
    import threading
    import time

    calls = []
    fake = {
        "peak_flops_f32": 1e11, "peak_flops_bf16": 5e10, "memory_bytes_per_s": 2e10,
        "fresh_bytes_per_s": 1e9, "launch_s": 1e-6, "cache_bytes_per_s": 1e11,
        "elementwise_per_s": 5e10, "transcendental_per_s": 5e9, "cache_bytes": 2**25,
    }  # fmt: skip

    def slow_measure(runs=5):
        calls.append(runs)
        time.sleep(0.2)  # the window in which the others asked
        return dict(fake)

    monkeypatch.setattr(calibration, "measure", slow_measure)
    monkeypatch.setenv("REMAT_KIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibration.CALIBRATION_ENV, raising=False)
    got, errors = [], []

    def ask():
        try:
            got.append(calibration.calibrate())
        except Exception as err:  # noqa: BLE001 (collected for the assertion)
            errors.append(err)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(calls) == 1 and len(got) == 6 and all(g == got[0] for g in got)
    assert [p.name for p in (tmp_path / "calibration").iterdir() if p.suffix != ".json"] == []


def test_a_file_replaced_from_many_threads_is_whole(tmp_path):
    """The one way files are replaced (:mod:`remat_kit.files`): concurrent writers of one
    destination each rename their own temporary file; the result is one writer's, whole."""
    from concurrent.futures import ThreadPoolExecutor

    from remat_kit import files

    dest = tmp_path / "out" / "x.json"
    texts = [json.dumps({"writer": i, "pad": "x" * 100_000}) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: files.write_text(dest, t), texts))
    assert dest.read_text() in texts
    assert sorted(p.name for p in dest.parent.iterdir()) == ["x.json"]  # no part left behind
    with pytest.raises(RuntimeError):  # a failed write leaves the old file and no part
        with files.replacing(dest) as part:
            part.write_text("torn")
            raise RuntimeError("killed mid-write")
    assert dest.read_text() in texts and len(list(dest.parent.iterdir())) == 1


def test_datasheet_figures_cite_their_sources():
    h100 = calibration.datasheet_figures(targets.get_target("h100-sxm"))
    assert h100 is not None and not h100.measured
    # the datasheet's peaks times the measured shares cited in the target's source
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12 * 794.5 / 989.0)
    assert h100.memory_bytes_per_s == pytest.approx(3.35e12 * 0.88)
    assert "datasheet" in h100.source and "CUDA C++ Programming Guide" in h100.source
    assert "Maximum Achievable Matmul FLOPS" in h100.source and "A100 80GB" in h100.source
    assert h100.sm_count == 132 and h100.node_size == 8 and h100.network_bytes_per_s == 50e9
    # 132 SMs x 16 special-function results per clock x 1.98 GHz
    assert h100.transcendental_per_s == pytest.approx(132 * 16 * 1.98e9)
    assert calibration.datasheet_figures(targets.get_target("cpu")) is None


def test_small_step_note_only_for_small_estimates_on_a_calibrated_device():
    from remat_kit.memory.roofline import SMALL_STEP_S, small_step_note

    small = SMALL_STEP_S / 10
    note = small_step_note([None, 2 * SMALL_STEP_S, small], measured=True)
    assert note is not None and f"{small * 1e3:.3g} ms" in note and "sweep" in note
    # datasheet figures (no small GPU/TPU step measured yet), large steps, no estimates: none
    assert small_step_note([small], measured=False) is None
    assert small_step_note([SMALL_STEP_S, 3 * SMALL_STEP_S], measured=True) is None
    assert small_step_note([None], measured=True) is None


#: XLA:GPU's scheduled form of the cases the GPU rules decide: a scan body stacking a residual
#: in place, an all-reduce whose result the next kernel needs (start and done adjacent), and
#: one started before an independent matmul it hides behind.
GPU_MODULE = """
HloModule gpu_rules, is_scheduled=true

%fused_stack (param_0: bf16[8,4,2048,1024], param_1: bf16[4,2048,1024], param_2: s32[]) -> bf16[8,4,2048,1024] {
  %param_0 = bf16[8,4,2048,1024]{3,2,1,0} parameter(0)
  %param_1 = bf16[4,2048,1024]{2,1,0} parameter(1)
  %bitcast.5 = bf16[1,4,2048,1024]{3,2,1,0} bitcast(%param_1)
  %param_2 = s32[] parameter(2)
  %constant.5 = s32[] constant(0)
  ROOT %dynamic-update-slice.5 = bf16[8,4,2048,1024]{3,2,1,0} dynamic-update-slice(%param_0, %bitcast.5, %param_2, %constant.5, %constant.5, %constant.5)
}

%body (state: (s32[], bf16[8,4,2048,1024], bf16[4,2048,1024])) -> (s32[], bf16[8,4,2048,1024], bf16[4,2048,1024]) {
  %state = (s32[], bf16[8,4,2048,1024]{3,2,1,0}, bf16[4,2048,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %stack = bf16[8,4,2048,1024]{3,2,1,0} get-tuple-element(%state), index=1
  %x = bf16[4,2048,1024]{2,1,0} get-tuple-element(%state), index=2
  %fusion.stack = bf16[8,4,2048,1024]{3,2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused_stack
  ROOT %tuple.5 = (s32[], bf16[8,4,2048,1024]{3,2,1,0}, bf16[4,2048,1024]{2,1,0}) tuple(%i, %fusion.stack, %x)
}

%cond (state.1: (s32[], bf16[8,4,2048,1024], bf16[4,2048,1024])) -> pred[] {
  %state.1 = (s32[], bf16[8,4,2048,1024]{3,2,1,0}, bf16[4,2048,1024]{2,1,0}) parameter(0)
  ROOT %constant.6 = pred[] constant(true)
}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %add.9 = bf16[] add(%a, %b)
}

ENTRY %main (p0: (s32[], bf16[8,4,2048,1024], bf16[4,2048,1024]), g: bf16[8192,1024], w: bf16[1024,1024]) -> (bf16[8192,1024], bf16[8192,1024], bf16[1024,1024]) {
  %p0 = (s32[], bf16[8,4,2048,1024]{3,2,1,0}, bf16[4,2048,1024]{2,1,0}) parameter(0)
  %g = bf16[8192,1024]{1,0} parameter(1)
  %w = bf16[1024,1024]{1,0} parameter(2)
  %while.5 = (s32[], bf16[8,4,2048,1024]{3,2,1,0}, bf16[4,2048,1024]{2,1,0}) while(%p0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  %all-reduce-start.1 = bf16[8192,1024]{1,0} all-reduce-start(%g), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_1'}, use_global_device_ids=true, to_apply=%add
  %all-reduce-done.1 = bf16[8192,1024]{1,0} all-reduce-done(%all-reduce-start.1)
  %all-reduce-start.2 = bf16[8192,1024]{1,0} all-reduce-start(%all-reduce-done.1), channel_id=2, replica_groups=[2,8]<=[16], use_global_device_ids=true, to_apply=%add
  %dot.5 = bf16[1024,1024]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %all-reduce-done.2 = bf16[8192,1024]{1,0} all-reduce-done(%all-reduce-start.2)
  ROOT %tuple.6 = (bf16[8192,1024]{1,0}, bf16[8192,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%all-reduce-done.1, %all-reduce-done.2, %dot.5)
}
"""


def test_gpu_rules_in_place_stack_and_collectives_on_the_critical_path():
    """A scan stacking a residual in place moves the update only; an all-reduce the next
    kernel waits for is charged in full; one the schedule overlaps with a matmul is charged
    only beyond the matmul's time."""
    comps = hlo.parse_hlo_module(GPU_MODULE)
    kernels = {k.name: k for k in K.executed_kernels(comps)}
    update = 4 * 2048 * 1024 * 2  # one [4, 2048, 1024] bf16 layer of the [8, ...] stack
    stack = kernels["fusion.stack"]
    assert stack.count == 8 and stack.bytes_written == update
    assert stack.bytes_read == update + 4  # the update and the index, not the 128 MiB stack
    first, second = kernels["all-reduce-start.1"], kernels["all-reduce-start.2"]
    assert first.group == tuple(range(8)) and second.group == tuple(range(8))
    wire = int(8192 * 1024 * 2 * 2 * 7 / 8)  # ring all-reduce over 8 devices
    assert first.bytes_read == second.bytes_read == wire

    figures = calibration.DeviceFigures(**{**FIGURES.__dict__, "interconnect_bytes_per_s": 1e10})
    step = roofline.estimate(comps, figures)
    link_s = wire / 1e10
    dot_s = 2 * 1024**3 / 4e12 + 1e-5  # bf16 peak, plus its launch
    assert dot_s < link_s
    # the first in full (its done is the next instruction), the second less the matmul
    assert step.collective_s == pytest.approx(link_s + (link_s - dot_s))
    assert step.memory_s == pytest.approx(8 * (2 * update + 4) / 1e11)


@pytest.mark.parametrize(
    ("attributes", "group"),
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add", (0, 1, 2, 3)),
        ("replica_groups=[2,4]<=[8], to_apply=%add", (0, 1, 2, 3)),
        ("replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add", (0, 4)),
        ("replica_groups=mesh['a'=2,'b'=4] {'a'}, to_apply=%add", (0, 4)),
        ("replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, to_apply=%add", (0, 1, 4, 5)),
        (
            "replica_groups=mesh['a'=4,'b'=3], device_ids=([3,4]T(1,0)) {'a'}, dimensions={0}",
            (0, 1, 2, 3),  # mesh position (i, 0) holds device i: the transposed iota
        ),
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}", (0, 2)),
        ("source_target_pairs={{0,1},{1,2}}", (0, 1)),
        ("replica_groups={}, to_apply=%add", ()),
    ],
)
def test_replica_group_in_each_form_xla_prints(attributes, group):
    instr = hlo.Instruction("all-reduce.1", "f32[8]{0}", "all-reduce", ("x",), attributes, "")
    assert K.replica_group(instr) == group


def test_collective_over_nodes_runs_at_the_nics_of_its_devices():
    """Inside one node a ring runs at the interconnect's rate; across nodes at the NICs of the
    group's devices per node (a tensor-parallel group inside a node, a data-parallel group of
    one device per node, an FSDP group of whole nodes)."""
    gpu = calibration.DeviceFigures(
        **{
            **FIGURES.__dict__,
            "interconnect_bytes_per_s": 300e9,
            "node_size": 8,
            "network_bytes_per_s": 25e9,
        }  # fmt: skip
    )
    assert roofline.collective_bandwidth(tuple(range(8)), gpu) == 300e9
    assert roofline.collective_bandwidth((0, 8, 16, 24), gpu) == 25e9
    assert roofline.collective_bandwidth(tuple(range(64)), gpu) == 8 * 25e9
    assert roofline.collective_bandwidth((), gpu) == 300e9  # unknown group: the interconnect
    tpu = calibration.DeviceFigures(**{**FIGURES.__dict__, "interconnect_bytes_per_s": 300e9})
    assert roofline.collective_bandwidth(tuple(range(64)), tpu) == 300e9  # one ICI domain


@pytest.mark.parametrize(
    ("gemm", "efficiency"),
    [
        ((1, 8192, 8192), 1.0),  # 64 x 32 tiles of 128 x 256: 2048 = 16 waves of 128
        ((1, 256, 256), 4 / 128),  # 4 tiles of 128 x 128 on a 128-SM GPU: 4 SMs busy
        ((1, 100, 128), 100 / 128 / 128),  # one 128 x 128 tile, partly used, one SM busy
        ((1, 8192, 8320), 8192 * 8320 / (33 * 128**3)),  # 4160 tiles of 128 x 128: 33 waves
        ((32, 2048, 2048), 1.0),  # a batched matmul: 32 x 256 tiles = 64 full waves
    ],
)
def test_gemm_efficiency_counts_tiles_and_waves(gemm, efficiency):
    assert roofline.gemm_efficiency(gemm, 128) == pytest.approx(efficiency)
    assert roofline.gemm_efficiency(gemm, 0) == 1.0  # no SMs: no quantization (a CPU)


def test_xla_cost_model_is_set_beside_the_estimate_loop_bodies_once():
    """XLA's cost analysis counts each loop body once: the cross-check counts this model's
    kernels once too, and warns only beyond a factor of XLA_DISAGREEMENT."""
    from remat_kit.memory.compile_cache import CachedExecutable, cost_fields

    comps = hlo.parse_hlo_module(LOOP_MODULE)
    step = roofline.estimate(comps, FIGURES)
    once = step.step_time_s / 4  # the loop runs its body 4 times
    assert roofline.cross_checked(step, comps, FIGURES, None) is step  # GPU: no XLA figure
    near = roofline.cross_checked(step, comps, FIGURES, {"optimal_seconds": once * 1.5})
    assert near.loop_once_s == pytest.approx(once) and near.xla_optimal_s == once * 1.5
    assert roofline.xla_disagreement(near) is None
    far = roofline.cross_checked(step, comps, FIGURES, {"optimal_seconds": once / 3})
    warning = roofline.xla_disagreement(far)
    assert warning is not None and "(3.00x)" in warning and "counted once" in warning
    assert roofline.StepTime.from_dict(far.to_dict()) == far
    # what a compile's cost analysis gives is kept through the compile cache's stand-in
    cost = {"flops": 2.0, "bytes accessed": 8.0, "optimal_seconds": 1e-6, "utilization0{}": 1.0}
    kept = cost_fields(CachedExecutable(None, None, cost))
    assert kept == {"flops": 2.0, "bytes accessed": 8.0, "optimal_seconds": 1e-6}
    assert cost_fields(CachedExecutable(None, None, None)) is None


def test_fused_attention_runs_at_the_measured_attention_rate():
    """A cuDNN fused attention call runs at the device's measured attention rate where it has
    one (Hopper: FlashAttention-3's cuDNN figures), not at the matmul rate."""
    kernel = K.Kernel(
        "fmha.1", "attention", 1, 1e12, "bf16", 0.0, 0.0, 0, 0, "", False, gemm=(32, 8192, 128)
    )
    assert roofline._matmul_seconds(kernel, FIGURES) == pytest.approx(1e12 / 4e12)
    fast = calibration.DeviceFigures(**{**FIGURES.__dict__, "attention_flops": {"bf16": 2e12}})
    assert roofline._matmul_seconds(kernel, fast) == pytest.approx(0.5)
    h100 = calibration.datasheet_figures(targets.get_target("h100-sxm"))
    assert h100.attention_flops["bf16"] == pytest.approx(989.4e12 * 529 / 989)
    assert "FlashAttention-3" in h100.source
    assert calibration.datasheet_figures(targets.get_target("a100-80gb")).attention_flops is None


def test_no_remat_slower_is_explained_on_datasheet_targets_only():
    note = roofline.no_remat_slower_note(
        {"no-remat": 0.053, "save-dots-no-batch": 0.0349, "save-nothing": 0.0351}, False
    )
    assert note is not None and note.startswith("no-remat is estimated 52% slower than ")
    assert "save-dots-no-batch" in note and "dynamic-update-slice" in note
    assert roofline.no_remat_slower_note({"no-remat": 0.03, "save-nothing": 0.04}, False) is None
    assert roofline.no_remat_slower_note({"no-remat": 0.05, "save-nothing": 0.04}, True) is None
    assert roofline.no_remat_slower_note({"save-nothing": 0.04}, False) is None


#: A Pallas kernel whose ``kernel_metadata`` frontend attribute is JSON over three lines (as
#: XLA's TPU compiler dumps MaxText's splash attention), then more work in the same computation.
SPLIT_MODULE = """HloModule split

ENTRY %main (p: f32[1024,1024], w: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  %w = f32[1024,1024]{1,0} parameter(1)
  %kernel.1 = f32[1024,1024]{1,0} custom-call(%p), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128, \\"note\\": \\"a } in a string\\"}"
}}, metadata={op_name="jit(step)/pallas_call"}
  %dot.1 = f32[1024,1024]{1,0} dot(%kernel.1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %dot.2 = f32[1024,1024]{1,0} dot(%dot.1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_an_instruction_over_several_lines_does_not_end_its_computation():
    """MaxText's splash attention on a TPU target: a kernel's metadata over three lines ended
    the entry computation at its ``}}`` line, so the step's remaining kernels (after its first
    attention call) were never costed: an offloading policy was estimated 5x faster."""
    comps = hlo.parse_hlo_module(SPLIT_MODULE)
    (entry,) = comps.values()
    assert [i.name for i in entry.instructions] == ["p", "w", "kernel.1", "dot.1", "dot.2"]
    assert "pallas_call" in entry.instructions[2].op_name
    kernels = _kernels(SPLIT_MODULE)
    assert {"dot.1", "dot.2"} <= set(kernels)
    assert hlo.count_flops(comps).flops == 2 * 2 * 1024**3
