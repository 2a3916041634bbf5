"""The suite's XLA flags change no figure: tests/conftest.py turns XLA's GPU autotuner off
(``--xla_gpu_autotune_level=0``) for every deviceless GPU compile of the suite; here the same
analysis made in a fresh process at XLA's default autotuning level gives the same report."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import AUTOTUNE_OFF, needs_cuda_plugin

ROOT = Path(__file__).resolve().parents[1]

#: The figures compared, from a bf16 model (cuDNN-eligible attention, Triton GEMM fusions) under
#: a policy that keeps the matmul (projection) outputs by offloading them to the host: GEMM
#: outputs among the kept residuals and host bytes, from one compile at each autotuning level
#: (no on-device twin: what is compared is this program's figures, not offload's effect).
_FIGURES = """
import remat_kit

def figures():
    config = remat_kit.get_config("tiny-llama", dtype="bfloat16", param_dtype="bfloat16")
    program = remat_kit.preset(config, 2, 64)
    reports = remat_kit.analyze_policies(  # no no-remat compile: the policy's own
        program, ["offload-to-host"], target="h100-sxm", top_k=0,
        no_remat_baseline=False, compare_offload=False,
    )
    return [
        {
            "policy": r.policy, "peak": r.peak_bytes, "host": r.host_bytes, "flops": r.flops,
            "ratio": r.recompute_ratio, "step_s": r.step_time.step_time_s,
            "kernels": [(k.name, k.bound) for k in r.step_time.top],
            "buffers": [(b.value, b.nbytes, b.shape, b.memory) for b in r.peak_buffers],
            "residuals": [(x.tag, x.shape, x.nbytes, x.memory) for x in r.residuals],
            "warnings": r.warnings,
        }
        for r in reports
    ]
"""


@needs_cuda_plugin
def test_gpu_figures_do_not_depend_on_the_autotuner_being_off(fresh_compile_cache):
    assert AUTOTUNE_OFF in os.environ["XLA_FLAGS"]
    namespace: dict = {}
    exec(_FIGURES, namespace)
    here = json.loads(json.dumps(namespace["figures"]()))  # tuples as the child's lists
    default = os.environ["XLA_FLAGS"].replace(AUTOTUNE_OFF, "").strip()
    # the child's compile cache off: it compiles at the default level (a hit of the run's
    # cache would compare the suite's compiles with themselves)
    env = {**os.environ, "XLA_FLAGS": default, "REMAT_KIT_NO_CACHE": "1"}
    code = f"{_FIGURES}\nimport json\nprint(json.dumps(figures()))"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    there = json.loads(run.stdout.splitlines()[-1])
    assert here == there
    assert [r["policy"] for r in here] == ["offload-to-host"]
    assert here[0]["host"] > 0  # the offload is real on the GPU target: host bytes compared
    # the matmul outputs are among the kept residuals, on the host: their figures compared
    on_host = {x[0] for x in here[0]["residuals"] if x[3] == "host"}
    assert {"query_proj", "out_proj", "mlpwi_0"} <= on_host, here[0]["residuals"]
