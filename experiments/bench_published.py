"""Published GPU training measurements beside remat-kit's deviceless step-time estimate.

Command (CPU machine; the GPU targets compile deviceless with the CUDA plugin)::

    python experiments/bench_published.py                    # all (~3 min cold, ~1 min cached)
    python experiments/bench_published.py --only k22-layer   # one entry (repeatable)
    python experiments/bench_published.py --list             # the table of entries, no compile
    python experiments/bench_published.py --check            # exit 1 unless every entry passes

Each entry of ``ENTRIES`` is one configuration a public source timed on A100 or H100 GPUs, with
the remat setting(s) it ran, the figure as printed, and where it is printed (the citations are in
``SOURCES`` and, with what each source measured and how its setting maps to a remat-kit policy, in
``docs/results/published.md``). For each entry the runner compiles the same shape with remat-kit,
deviceless, for the named target and mesh (``remat_kit.analyze_policies`` of
``remat_kit.preset(config, batch, seq, optimizer, mesh)``, one policy per published setting) and
reads the estimated step time (``MemoryReport.step_time_s``: the roofline over the compiled
kernels):

- ``measure="step"``: the step compiled at the model's full depth (the layer scan compiles one
  block, so depth costs no compile time) against the published step time;
- ``measure="per-layer"``: (step with 4 layers - step with 2 layers) / 2, everything else the
  same, against a published per-layer time.

Published throughputs become seconds per compiled step: tokens/s/GPU ->
``batch * seq / (GPUs * throughput)`` (``batch`` = the sequences of one micro-batch over all
GPUs, the step remat-kit compiles); Megatron's achieved TFLOP/s per GPU -> ``F / (GPUs * X)`` with
F the FLOPs per iteration of Narayanan et al. 2021, eq. (3).

Where a source timed two remat settings of one configuration (``pairs``), the overhead
``t(slower) / t(faster) - 1`` is compared too. ``--check`` passes an entry when every estimate is
within 0.7x-1.4x of its published figure, every overhead within 10 percentage points of the
published one, and the settings rank in the published order; it exits 1 otherwise.

Writes ``DIR/published.json`` (``--out DIR``, default ``experiments/results/published/``: the
entries, every compiled report's step-time breakdown, the check) and ``DIR/published.md`` (the
tables printed to stdout). One compile at a time; compiles are cached under
``~/.cache/remat-kit`` (``REMAT_KIT_CACHE_DIR``), so a second run only re-reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "published"

#: ``--check`` bounds: estimate / published, and overhead difference in percentage points.
RATIO_LO, RATIO_HI = 0.7, 1.4
OVERHEAD_PP = 10.0


@dataclasses.dataclass(frozen=True)
class Source:
    """One public source: what to cite and where its numbers were read."""

    key: str
    citation: str  # authors, title, venue / arXiv number, or the repository file
    read_at: str  # where the figures were read (stored copy, commit)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One published remat setting of an entry and its measured figure."""

    name: str  # the source's words for the setting
    policy: str  # remat-kit policy: a registered name or a per-tag spec 'tag=save,...'
    value: float  # the figure as printed
    unit: str  # 'ms/layer', 's/iteration', 'tokens/s/GPU' or 'TFLOP/s/GPU'
    where: str  # table / row / column it is printed in


@dataclasses.dataclass(frozen=True)
class Entry:
    """One published configuration, compiled the same way with remat-kit."""

    id: str
    source: str  # key of SOURCES
    gpu: str  # the hardware in the source's words
    target: str  # remat-kit target
    mesh: str  # remat-kit mesh (dp / fsdp / tp sizes)
    parallelism: str  # the parallelism in the source's words
    preset: str  # remat-kit preset the overrides apply to
    overrides: tuple[tuple[str, Any], ...]
    batch: int  # sequences in the compiled step: one micro-batch on every GPU
    seq: int
    measure: str  # 'step' or 'per-layer'
    settings: tuple[Setting, ...]
    pairs: tuple[tuple[str, str], ...] = ()  # (slower, faster) setting names
    optimizer: str = "adamw"
    micro_batch: str = ""  # how the source's batch maps to the compiled step
    notes: str = ""
    published_params: int | None = None  # parameter count the source prints, if any

    def config(self, **more: Any):
        from remat_kit import get_config

        return get_config(self.preset, **{**dict(self.overrides), **more})

    @property
    def devices(self) -> int:
        from remat_kit.targets import parse_mesh

        return parse_mesh(self.mesh).num_devices

    def setting(self, name: str) -> Setting:
        (s,) = [s for s in self.settings if s.name == name]
        return s


SOURCES = {
    s.key: s
    for s in [
        Source(
            "korthikanti2022",
            "V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro, "
            "'Reducing Activation Recomputation in Large Transformer Models', arXiv:2205.05198 "
            "(MLSys 2023)",
            "full text of arXiv:2205.05198 (a stored Markdown transcription of the PDF): Tables 3, "
            "4 and 5, Section 6",
        ),
        Source(
            "narayanan2021",
            "D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti et al., "
            "'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM', "
            "arXiv:2104.04473 (SC21)",
            "full text of arXiv:2104.04473 (a stored Markdown transcription): Section 5, Table 1 "
            "and equation (3)",
        ),
        Source(
            "llm-foundry",
            "MosaicML llm-foundry, scripts/train/benchmarking/README.md ('MPT Training "
            "Benchmarks'), https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/"
            "benchmarking/README.md",
            "github.com/mosaicml/llm-foundry at 8c8dd48f72168c5d51e2f7b151595892a8fba43d "
            "(2025-07-21); model shapes from scripts/train/yamls/pretrain/mpt-7b.yaml",
        ),
        Source(
            "torchtitan",
            "torchtitan team, benchmarks/llama3_h100_202412_torchtitan.md, "
            "https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
            "llama3_h100_202412_torchtitan.md (runs: torchtitan 9dec370, torch 1963fc8, "
            "2024-12)",
            "github.com/pytorch/torchtitan at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a; training "
            "config train_configs/llama3_8b.toml and the AC policy "
            "torchtitan/parallelisms/parallelize_llama.py at 9dec370",
        ),
        Source(
            "fms-fsdp",
            "IBM / foundation-model-stack, fms-fsdp README.md, 'Training throughput benchmarks' "
            "(the figures of the PyTorch blog 'Maximizing training throughput using PyTorch "
            "FSDP', March 2024), https://github.com/foundation-model-stack/fms-fsdp/blob/"
            "4ffb9bd/README.md",
            "github.com/foundation-model-stack/fms-fsdp at 4ffb9bd (2024-03-21): README.md, "
            "fms_fsdp/config/training.py, fms_fsdp/utils/config_utils.py, "
            "fms_fsdp/policies/ac_handler.py",
        ),
    ]
}

_GPT_22B = (
    ("d_model", 6144),
    ("num_heads", 64),
    ("d_ff", 24576),
    ("num_layers", 48),
    ("vocab_size", 51200),
    ("max_seq_len", 2048),
)
_MPT_7B = (
    ("d_model", 4096),
    ("num_heads", 32),
    ("d_ff", 16384),
    ("num_layers", 32),
    ("vocab_size", 50368),
    ("attention", "cudnn"),
)
# torchtitan's op-level selective AC (parallelize_llama.py at 9dec370): per block, save the
# outputs of aten.mm except every second one, and of flash / efficient SDPA. Block order wq(1)
# wk(2) wv(3) sdpa wo(4) w1(5) w3(6) w2(7): wq, wv, w1 (the SiLU gate, remat-kit's mlpwi_0), w2
# and the attention output are saved; wk, wo, w3 recomputed.
TITAN_SAC = "query_proj=save,value_proj=save,context=save,mlpwi_0=save,mlpwo=save"

ENTRIES: tuple[Entry, ...] = (
    Entry(
        id="k22-layer",
        source="korthikanti2022",
        gpu="8x A100 80GB SXM (one DGX A100 node of Selene, NVLink/NVSwitch)",
        target="a100-80gb",
        mesh="tp=8",
        parallelism="tensor parallel 8 (Megatron-LM), pipeline 1, no data parallel",
        preset="gpt2-small",
        overrides=_GPT_22B,
        batch=4,
        seq=2048,
        measure="per-layer",
        optimizer="sgd",
        settings=(
            Setting(
                "no recompute",
                "no-remat",
                19.6,
                "ms/layer",
                "Table 4, row 'Baseline no recompute', column 'Combined (ms)'",
            ),
            Setting(
                "full recompute",
                "save-nothing",
                27.2,
                "ms/layer",
                "Table 4, row 'Baseline with recompute', column 'Combined (ms)'",
            ),
            Setting(
                "selective recompute",
                "save-dots-no-batch",
                20.9,
                "ms/layer",
                "Table 4, row 'Selective Recompute', column 'Combined (ms)'",
            ),
        ),
        pairs=(("full recompute", "no recompute"), ("selective recompute", "no recompute")),
        micro_batch="Table 3: global batch 4 = micro-batch 4 on one tp=8 group",
        notes="forward + backward of one transformer layer of the 22B GPT (Table 3: h=6144, "
        "64 heads, 48 layers, s=2048, v=51200); SGD update in the compiled step (the smallest: "
        "the table times no optimizer); rows with sequence parallelism left out (remat-kit's tp "
        "has none)",
    ),
    Entry(
        id="k22-step",
        source="korthikanti2022",
        gpu="8x A100 80GB SXM (one DGX A100 node of Selene, NVLink/NVSwitch)",
        target="a100-80gb",
        mesh="tp=8",
        parallelism="tensor parallel 8 (Megatron-LM), pipeline 1, no data parallel",
        preset="gpt2-small",
        overrides=_GPT_22B,
        batch=4,
        seq=2048,
        measure="step",
        settings=(
            Setting(
                "full recompute",
                "save-nothing",
                1.42,
                "s/iteration",
                "Table 5, row '22B', column 'Iteration Time (seconds) / Full Recompute'",
            ),
            Setting(
                "present work (selective + sequence parallel)",
                "save-dots-no-batch",
                1.10,
                "s/iteration",
                "Table 5, row '22B', column 'Iteration Time (seconds) / Present Work'",
            ),
        ),
        pairs=(("full recompute", "present work (selective + sequence parallel)"),),
        micro_batch="Table 3: global batch 4 = micro-batch 4; one micro-batch per iteration",
        notes="end-to-end iteration of the whole 22B model (48 layers); 'present work' also has "
        "sequence parallelism, which remat-kit does not model (Table 4: -3% per layer)",
    ),
    Entry(
        id="n21-1.7b-dp32",
        source="narayanan2021",
        gpu="32x A100 80GB SXM (4 DGX A100 nodes of Selene, 8x 200 Gb/s HDR InfiniBand each)",
        target="a100-80gb",
        mesh="dp=32",
        parallelism="data parallel 32 (tensor 1, pipeline 1)",
        preset="gpt2-small",
        overrides=(
            ("d_model", 2304),
            ("num_heads", 24),
            ("d_ff", 9216),
            ("num_layers", 24),
            ("vocab_size", 51200),
            ("max_seq_len", 2048),
        ),
        batch=512,
        seq=2048,
        measure="step",
        settings=(
            Setting(
                "activation recomputation",
                "save-nothing",
                137.0,
                "TFLOP/s/GPU",
                "Table 1, row 1.7B, column 'Achieved teraFLOP/s per GPU'",
            ),
        ),
        micro_batch="Table 1 gives the global batch (512) but no micro-batch: the whole "
        "iteration (16 sequences per GPU) is compiled as one step",
        notes="throughput is end to end (data loading, optimizer, communication, logging); "
        "eq. (3) FLOPs assume activation recomputation",
    ),
    Entry(
        id="n21-18.4b-tp8-dp32",
        source="narayanan2021",
        gpu="256x A100 80GB SXM (32 DGX A100 nodes of Selene, 8x 200 Gb/s HDR InfiniBand each)",
        target="a100-80gb",
        mesh="dp=32,tp=8",
        parallelism="tensor parallel 8 x data parallel 32 (pipeline 1)",
        preset="gpt2-small",
        overrides=(
            ("d_model", 6144),
            ("num_heads", 48),
            ("d_ff", 24576),
            ("num_layers", 40),
            ("vocab_size", 51200),
            ("max_seq_len", 2048),
        ),
        batch=1024,
        seq=2048,
        measure="step",
        settings=(
            Setting(
                "activation recomputation",
                "save-nothing",
                135.0,
                "TFLOP/s/GPU",
                "Table 1, row 18.4B, column 'Achieved teraFLOP/s per GPU'",
            ),
        ),
        micro_batch="global batch 1024 over 32 data-parallel groups, micro-batch not given: "
        "the whole iteration (32 sequences per tp group) is compiled as one step",
        notes="as n21-1.7b-dp32",
    ),
    Entry(
        id="foundry-mpt7b-a100-noac",
        source="llm-foundry",
        gpu="8x A100 80GB (one node; '1600 Gbps node-node interconnect (RoCE)' table)",
        target="a100-80gb",
        mesh="fsdp=8",
        parallelism="PyTorch FSDP FULL_SHARD (ZeRO-3) over 8 GPUs",
        preset="gpt2-small",
        overrides=(*_MPT_7B, ("max_seq_len", 2048)),
        batch=48,
        seq=2048,
        measure="step",
        settings=(
            Setting(
                "activation checkpointing False",
                "no-remat",
                4641.0,
                "tokens/s/GPU",
                "table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)', row 7b / "
                "2048 / 8 GPUs (MicroBatchSize 6, GradAccum 2), column "
                "'Throughput (T/s/GPU)'",
            ),
        ),
        published_params=6658859008,
        micro_batch="micro-batch 6 per GPU, 2 accumulation steps: one micro-batch (6 x 8 = 48 "
        "sequences) compiled; published seconds = 6 x 2048 / (T/s/GPU)",
        notes="MPT-7B (d 4096, 32 heads, 32 layers, ffn 4x, vocab 50368, learned positions, "
        "biases; 6,658,859,008 parameters as the table's NumParams), FlashAttention "
        "(attn_impl flash -> remat-kit attention=cudnn), amp_bf16",
    ),
    Entry(
        id="foundry-mpt7b-h100-noac",
        source="llm-foundry",
        gpu="8x H100 80GB (one node)",
        target="h100-sxm",
        mesh="fsdp=8",
        parallelism="PyTorch FSDP FULL_SHARD (ZeRO-3) over 8 GPUs",
        preset="gpt2-small",
        overrides=(*_MPT_7B, ("max_seq_len", 2048)),
        batch=48,
        seq=2048,
        measure="step",
        settings=(
            Setting(
                "activation checkpointing False",
                "no-remat",
                10643.0,
                "tokens/s/GPU",
                "table 'H100 80GB BF16', row 7b / 2048 / 8 GPUs (MicroBatchSize 6, "
                "GradAccum 1), column 'Throughput (T/s/GPU)'",
            ),
        ),
        published_params=6658859008,
        micro_batch="micro-batch 6 per GPU, no accumulation: 48 sequences compiled",
        notes="as foundry-mpt7b-a100-noac",
    ),
    Entry(
        id="foundry-mpt7b-a100-ac",
        source="llm-foundry",
        gpu="8x A100 80GB (one node; '1600 Gbps node-node interconnect (RoCE)' table)",
        target="a100-80gb",
        mesh="fsdp=8",
        parallelism="PyTorch FSDP FULL_SHARD (ZeRO-3) over 8 GPUs",
        preset="gpt2-small",
        overrides=(*_MPT_7B, ("max_seq_len", 4096)),
        batch=128,
        seq=4096,
        measure="step",
        settings=(
            Setting(
                "activation checkpointing True",
                "save-nothing",
                3684.0,
                "tokens/s/GPU",
                "table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)', row 7b / "
                "4096 / 8 GPUs (MicroBatchSize 16, GradAccum 2), column "
                "'Throughput (T/s/GPU)'",
            ),
        ),
        published_params=6667247616,
        micro_batch="micro-batch 16 per GPU, 2 accumulation steps: one micro-batch (16 x 8 = "
        "128 sequences) compiled; published seconds = 16 x 4096 / (T/s/GPU)",
        notes="as foundry-mpt7b-a100-noac, s=4096 (NumParams 6,667,247,616: learned position "
        "table of 4096); FSDP activation_checkpointing wraps every MPTBlock",
    ),
    Entry(
        id="foundry-mpt7b-h100-ac",
        source="llm-foundry",
        gpu="8x H100 80GB (one node)",
        target="h100-sxm",
        mesh="fsdp=8",
        parallelism="PyTorch FSDP FULL_SHARD (ZeRO-3) over 8 GPUs",
        preset="gpt2-small",
        overrides=(*_MPT_7B, ("max_seq_len", 4096)),
        batch=128,
        seq=4096,
        measure="step",
        settings=(
            Setting(
                "activation checkpointing True",
                "save-nothing",
                8611.0,
                "tokens/s/GPU",
                "table 'H100 80GB BF16', row 7b / 4096 / 8 GPUs (MicroBatchSize 16, "
                "GradAccum 2), column 'Throughput (T/s/GPU)'",
            ),
        ),
        published_params=6667247616,
        micro_batch="micro-batch 16 per GPU, 2 accumulation steps: 128 sequences compiled",
        notes="as foundry-mpt7b-a100-ac",
    ),
    Entry(
        id="titan-llama3-8b-h100-fsdp8",
        source="torchtitan",
        gpu="8x H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit; Grand Teton, NVLink)",
        target="h100-sxm",
        mesh="fsdp=8",
        parallelism="FSDP2 (fully_shard, ZeRO-3) over 8 GPUs",
        preset="llama3-8b",
        overrides=(("attention", "cudnn"),),
        batch=16,
        seq=8192,
        measure="step",
        settings=(
            Setting(
                "selective activation checkpointing (op)",
                TITAN_SAC,
                5762.0,
                "tokens/s/GPU",
                "Table 1, row 'FSDP', column 'TPS/GPU'",
            ),
        ),
        micro_batch="local batch 2, global 16, no accumulation: 16 sequences compiled",
        notes="Llama 3.1 8B, seq_len 8192 (train_configs/llama3_8b.toml at 9dec370), SDPA "
        "flash attention, bf16, no torch.compile, no Float8; TPS read at iteration 90",
    ),
    Entry(
        id="titan-llama3-8b-h100-fsdp128",
        source="torchtitan",
        gpu="128x H100 (96 GB HBM2e, 500 W; 8 per host on NVLink, 400 Gb/s RDMA per GPU)",
        target="h100-sxm",
        mesh="fsdp=128",
        parallelism="FSDP2 (fully_shard, ZeRO-3) over 128 GPUs",
        preset="llama3-8b",
        overrides=(("attention", "cudnn"),),
        batch=256,
        seq=8192,
        measure="step",
        settings=(
            Setting(
                "selective activation checkpointing (op)",
                TITAN_SAC,
                5605.0,
                "tokens/s/GPU",
                "Table 3, row 'FSDP', column 'TPS/GPU'",
            ),
        ),
        micro_batch="local batch 2, global 256, no accumulation: 256 sequences compiled",
        notes="as titan-llama3-8b-h100-fsdp8",
    ),
    Entry(
        id="fms-llama2-7b-a100-hsdp",
        source="fms-fsdp",
        gpu="128x A100 80GB (16 nodes, 400 Gbps)",
        target="a100-80gb",
        mesh="dp=16,fsdp=8",
        parallelism="HSDP (FSDP HYBRID_SHARD): sharded over the 8 GPUs of a node, replicated "
        "over 16 nodes",
        preset="llama2-7b",
        overrides=(("attention", "cudnn"),),
        batch=256,
        seq=4096,
        measure="step",
        settings=(
            Setting(
                "No AC",
                "no-remat",
                3700.0,
                "tokens/s/GPU",
                "'Training throughput benchmarks' table, row 7b (HSDP, No AC, batch 2), "
                "column 'tokens/sec/GPU A100 80G 128 GPUs with 400Gbps'",
            ),
        ),
        micro_batch="batch_size 2 per GPU (training.py), no accumulation: 256 sequences compiled",
        notes="Llama 2 7B shape (fms LLaMAConfig defaults: d 4096, 32 heads, 32 layers, ffn "
        "11008, vocab 32000), seq_length 4096, SDPA flash attention, FSDP bfSixteen mixed "
        "precision, no torch.compile",
    ),
    Entry(
        id="fms-llama2-7b-h100-hsdp",
        source="fms-fsdp",
        gpu="96x H100 80GB (12 nodes, 800 Gbps)",
        target="h100-sxm",
        mesh="dp=12,fsdp=8",
        parallelism="HSDP: sharded over the 8 GPUs of a node, replicated over 12 nodes",
        preset="llama2-7b",
        overrides=(("attention", "cudnn"),),
        batch=192,
        seq=4096,
        measure="step",
        settings=(
            Setting(
                "No AC",
                "no-remat",
                7500.0,
                "tokens/s/GPU",
                "'Training throughput benchmarks' table, row 7b (HSDP, No AC, batch 2), "
                "column 'tokens/sec/GPU H100 96 GPUs with 800 Gbps'",
            ),
        ),
        micro_batch="batch 2 per GPU: 192 sequences compiled",
        notes="as fms-llama2-7b-a100-hsdp",
    ),
    Entry(
        id="fms-llama2-70b-a100-fsdp",
        source="fms-fsdp",
        gpu="128x A100 80GB (16 nodes, 400 Gbps)",
        target="a100-80gb",
        mesh="fsdp=128",
        parallelism="FSDP FULL_SHARD (ZeRO-3) over 128 GPUs",
        preset="llama3-70b",
        overrides=(("vocab_size", 32000), ("max_seq_len", 4096), ("attention", "cudnn")),
        batch=256,
        seq=4096,
        measure="step",
        settings=(
            Setting(
                "Full AC",
                "save-nothing",
                370.0,
                "tokens/s/GPU",
                "'Training throughput benchmarks' table, row 70b (FSDP, Full AC, batch 2), "
                "column 'tokens/sec/GPU A100 80G 128 GPUs with 400Gbps'",
            ),
        ),
        micro_batch="batch 2 per GPU: 256 sequences compiled",
        notes="Llama 2 70B shape (config_utils.py '70b': d 8192, 64 heads, 8 KV heads, 80 "
        "layers, ffn 28672, vocab 32000): remat-kit's llama3-70b with vocab 32000; Full AC = "
        "apply_fsdp_checkpointing with every_xth_item 1 (every LLaMABlock)",
    ),
    Entry(
        id="fms-llama2-70b-h100-fsdp",
        source="fms-fsdp",
        gpu="96x H100 80GB (12 nodes, 800 Gbps)",
        target="h100-sxm",
        mesh="dp=3,fsdp=32",
        parallelism="FSDP FULL_SHARD (ZeRO-3) over 96 GPUs (remat-kit: fsdp=32 x dp=3, as 96 "
        "divides neither d_model 8192 nor the FFN 28672)",
        preset="llama3-70b",
        overrides=(("vocab_size", 32000), ("max_seq_len", 4096), ("attention", "cudnn")),
        batch=192,
        seq=4096,
        measure="step",
        settings=(
            Setting(
                "Full AC",
                "save-nothing",
                800.0,
                "tokens/s/GPU",
                "'Training throughput benchmarks' table, row 70b (FSDP, Full AC, batch 2), "
                "column 'tokens/sec/GPU H100 96 GPUs with 800 Gbps'",
            ),
        ),
        micro_batch="batch 2 per GPU: 192 sequences compiled",
        notes="as fms-llama2-70b-a100-fsdp; remat-kit shards each array along one dimension, "
        "PyTorch FSDP a flat buffer: FULL_SHARD over 96 becomes fsdp=32 x dp=3 (per-GPU compute "
        "the same, parameter all-gather and gradient reduce-scatter volumes within 3%, plus a "
        "gradient all-reduce of 1/32 of the gradients over 3 replicas)",
    ),
)


def narayanan_flops(entry: Entry) -> float:
    """FLOPs of one iteration, Narayanan et al. 2021 eq. (3) (activation recomputation counted):
    ``96 B s l h^2 (1 + s / 6h + V / 16lh)``."""
    c = entry.config()
    b, s, n, h, v = entry.batch, entry.seq, c.num_layers, c.d_model, c.vocab_size
    return 96 * b * s * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))


def published_seconds(entry: Entry, setting: Setting) -> float:
    """The published figure as seconds per compiled step (or per layer)."""
    if setting.unit == "ms/layer":
        return setting.value / 1e3
    if setting.unit == "s/iteration":
        return setting.value
    if setting.unit == "tokens/s/GPU":
        return entry.batch * entry.seq / (entry.devices * setting.value)
    if setting.unit == "TFLOP/s/GPU":
        return narayanan_flops(entry) / (entry.devices * setting.value * 1e12)
    raise ValueError(f"{entry.id}: unknown unit {setting.unit!r}")


def policy_arg(policy: str) -> str | dict[str, str]:
    """A registered name as is; a per-tag spec 'tag=save,...' as the mapping the API takes."""
    if "=" not in policy:
        return policy
    return dict(part.split("=", 1) for part in policy.split(","))


def param_count(entry: Entry) -> int:
    """Parameters of the model remat-kit compiles (full depth), from abstract shapes."""
    import math

    import jax

    from remat_kit import abstract_train_state, make_optimizer

    state = abstract_train_state(entry.config(), make_optimizer("sgd"))
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(state.params))


def shape_text(entry: Entry) -> str:
    c = entry.config()
    kv = f"/{c.kv_heads}kv" if c.kv_heads != c.num_heads else ""
    layers = "2,4" if entry.measure == "per-layer" else c.num_layers
    return (
        f"h={c.d_model} a={c.num_heads}{kv} L={layers} ff={c.d_ff} V={c.vocab_size} "
        f"{c.mlp} {c.attention}"
    )


def mesh_text(entry: Entry) -> str:
    from remat_kit.targets import parse_mesh

    m = parse_mesh(entry.mesh)
    return f"dp={m.dp} fsdp={m.fsdp} tp={m.tp} ({m.num_devices} GPUs)"


def compile_reports(entry: Entry, num_layers: int | None) -> list[dict]:
    """Compile ``entry`` under each of its settings' policies (at ``num_layers`` if given);
    one dict per setting: step time, its breakdown and compile facts, or the error."""
    from remat_kit import analyze_policies, preset

    more = {"num_layers": num_layers} if num_layers is not None else {}
    policies = [policy_arg(s.policy) for s in entry.settings]
    t0 = time.perf_counter()
    try:
        program = preset(entry.config(**more), entry.batch, entry.seq, entry.optimizer, entry.mesh)
    except ValueError as exc:  # a shape the mesh does not divide, a bad override: no estimate
        print(f"  {entry.id}: {exc}", file=sys.stderr, flush=True)
        return [{"setting": s.name, "error": str(exc)[:300]} for s in entry.settings]
    reports = analyze_policies(
        program,
        policies,
        entry.target,
        workers=1,
        raise_errors=False,
        compare_offload=False,
        no_remat_baseline=False,
    )
    wall = time.perf_counter() - t0
    out = []
    for setting, r in zip(entry.settings, reports, strict=True):
        if isinstance(r, Exception):
            out.append({"setting": setting.name, "error": str(r).splitlines()[0][:300]})
            continue
        st = r.step_time
        out.append(
            {
                "setting": setting.name,
                "num_layers": program.family.structure.num_layers,
                "step_time_s": r.step_time_s,
                "breakdown": None
                if st is None
                else {
                    k: v
                    for k, v in dataclasses.asdict(st).items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                },
                "peak_gib": r.peak_bytes / 2**30 if r.peak_bytes is not None else None,
                "fits": r.fits,
                "recompute_ratio": r.recompute_ratio,
                "compile_s": r.compile_s,
                "compile_cached": r.compile_cached,
                "warnings": list(r.warnings),
            }
        )
    layers = program.family.structure.num_layers
    print(
        f"  {entry.id}: {len(policies)} policies at {layers} layers in {wall:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return out


def estimate(entry: Entry) -> dict[str, dict]:
    """``{setting name: {"estimate_s": ..., "compiles": [...]}}`` for one entry."""
    if entry.measure == "step":
        runs = [compile_reports(entry, None)]
    elif entry.measure == "per-layer":
        runs = [compile_reports(entry, 2), compile_reports(entry, 4)]
    else:
        raise ValueError(f"{entry.id}: unknown measure {entry.measure!r}")
    out = {}
    for i, setting in enumerate(entry.settings):
        compiles = [run[i] for run in runs]
        times = [c.get("step_time_s") for c in compiles]
        if any(t is None for t in times):
            est = None
        elif entry.measure == "step":
            est = times[0]
        else:
            est = (times[1] - times[0]) / 2
        out[setting.name] = {"estimate_s": est, "compiles": compiles}
    return out


def evaluate(entry: Entry, est: dict[str, dict]) -> dict:
    """Rows (one per setting), pairs and the pass / fail of one entry."""
    rows, pairs, problems = [], [], []
    params = param_count(entry)
    if entry.published_params is not None and params != entry.published_params:
        problems.append(f"model has {params:,} parameters, the source {entry.published_params:,}")
    for s in entry.settings:
        pub = published_seconds(entry, s)
        e = est[s.name]["estimate_s"]
        ratio = e / pub if e is not None else None
        ok = ratio is not None and RATIO_LO <= ratio <= RATIO_HI
        if not ok:
            problems.append(
                f"{s.name}: estimate/published "
                + (f"{ratio:.2f}" if ratio is not None else "n/a (no estimate)")
                + f" outside {RATIO_LO}-{RATIO_HI}"
            )
        rows.append(
            {
                "id": entry.id,
                "source": entry.source,
                "gpu": entry.gpu,
                "target": entry.target,
                "mesh": entry.mesh,
                "parallelism": mesh_text(entry),
                "model": shape_text(entry),
                "batch": entry.batch,
                "seq": entry.seq,
                "measure": entry.measure,
                "setting": s.name,
                "policy": s.policy,
                "published": s.value,
                "unit": s.unit,
                "where": s.where,
                "published_s": pub,
                "estimate_s": e,
                "ratio": ratio,
                "ok": ok,
            }
        )
    for slow, fast in entry.pairs:
        pub = published_seconds(entry, entry.setting(slow)) / published_seconds(
            entry, entry.setting(fast)
        )
        es, ef = est[slow]["estimate_s"], est[fast]["estimate_s"]
        est_ovh = (es / ef - 1) * 100 if es is not None and ef else None
        pub_ovh = (pub - 1) * 100
        diff = est_ovh - pub_ovh if est_ovh is not None else None
        ok = diff is not None and abs(diff) <= OVERHEAD_PP
        if not ok:
            problems.append(
                f"overhead {slow} / {fast}: published {pub_ovh:+.1f}%, estimated "
                + (f"{est_ovh:+.1f}% ({diff:+.1f} pp)" if est_ovh is not None else "n/a")
            )
        pairs.append(
            {
                "id": entry.id,
                "slower": slow,
                "faster": fast,
                "published_overhead_pct": pub_ovh,
                "estimated_overhead_pct": est_ovh,
                "difference_pp": diff,
                "ok": ok,
            }
        )
    if len(entry.settings) > 1:
        by_pub = sorted(entry.settings, key=lambda s: published_seconds(entry, s))
        times = {s.name: est[s.name]["estimate_s"] for s in entry.settings}
        if any(t is None for t in times.values()):
            order_ok = False
        else:
            by_est = sorted(entry.settings, key=lambda s: times[s.name])
            order_ok = [s.name for s in by_est] == [s.name for s in by_pub]
        if not order_ok:
            problems.append(
                "order: published "
                + " < ".join(s.name for s in by_pub)
                + "; estimated "
                + " < ".join(sorted(times, key=lambda n: times[n] or float("inf")))
            )
    return {
        "id": entry.id,
        "params": params,
        "rows": rows,
        "pairs": pairs,
        "pass": not problems,
        "problems": problems,
    }


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _secs(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def markdown(results: list[dict]) -> str:
    lines = [
        "| id | source | GPU (target) | parallelism | model | batch | seq | remat setting -> "
        "policy | published | published (s) | estimate | est/pub | ok |",
        "|---|---|---|---|---|--:|--:|---|---|--:|--:|--:|---|",
    ]
    for res in results:
        for r in res["rows"]:
            per = " per layer" if r["measure"] == "per-layer" else ""
            lines.append(
                f"| {r['id']} | {r['source']} | {r['target']} | {r['parallelism']} | "
                f"{r['model']} | {r['batch']} | {r['seq']} | {r['setting']} -> `{r['policy']}` "
                f"| {r['published']:g} {r['unit']} | {_secs(r['published_s'])}{per} | "
                f"{_secs(r['estimate_s'])}{per} | {_f(r['ratio'], '.2f')} | "
                f"{'yes' if r['ok'] else 'NO'} |"
            )
    pair_rows = [p for res in results for p in res["pairs"]]
    if pair_rows:
        lines += [
            "",
            "| id | pair (slower / faster) | published overhead | estimated overhead | "
            "difference | ok |",
            "|---|---|--:|--:|--:|---|",
        ]
        for p in pair_rows:
            lines.append(
                f"| {p['id']} | {p['slower']} / {p['faster']} | "
                f"{p['published_overhead_pct']:+.1f}% | "
                f"{_f(p['estimated_overhead_pct'], '+.1f')}% | "
                f"{_f(p['difference_pp'], '+.1f')} pp | {'yes' if p['ok'] else 'NO'} |"
            )
    lines += ["", "| id | check | why |", "|---|---|---|"]
    for res in results:
        why = "; ".join(res["problems"]) or "-"
        lines.append(f"| {res['id']} | {'pass' if res['pass'] else 'FAIL'} | {why} |")
    return "\n".join(lines) + "\n"


def listing(entries: Sequence[Entry]) -> str:
    lines = [
        "| id | source | GPU | target | mesh | model | batch | seq | measure | setting -> "
        "policy | published | published (s) |",
        "|---|---|---|---|---|---|--:|--:|---|---|---|--:|",
    ]
    for e in entries:
        for s in e.settings:
            lines.append(
                f"| {e.id} | {e.source} | {e.gpu} | {e.target} | {e.mesh} | {shape_text(e)} | "
                f"{e.batch} | {e.seq} | {e.measure} | {s.name} -> `{s.policy}` | "
                f"{s.value:g} {s.unit} | {published_seconds(e, s):.4f} |"
            )
    return "\n".join(lines) + "\n"


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.rstrip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def meta() -> dict:
    import jax

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "remat_kit_commit": _git("rev-parse", "HEAD"),
        "remat_kit_uncommitted": _git("status", "--porcelain", "--", "remat_kit").splitlines(),
        "jax": jax.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "backend": "deviceless GPU compile (XLA GPU compiler on the CPU host)",
        "check_bounds": {"ratio": [RATIO_LO, RATIO_HI], "overhead_pp": OVERHEAD_PP},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", metavar="ID", help="run this entry (repeatable)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results folder (default {OUT})")
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every entry is within 0.7x-1.4x of its published "
        "figure and every overhead within 10 pp, in the published order",
    )
    ap.add_argument("--list", action="store_true", help="print the entries; compile nothing")
    args = ap.parse_args(argv)

    ids = [e.id for e in ENTRIES]
    if len(set(ids)) != len(ids):
        raise SystemExit("duplicate entry ids")
    entries = list(ENTRIES)
    if args.only:
        unknown = [i for i in args.only if i not in ids]
        if unknown:
            ap.error(f"unknown entry {', '.join(unknown)}; entries: {', '.join(ids)}")
        entries = [e for e in ENTRIES if e.id in args.only]
    if args.list:
        print(listing(entries), end="")
        return 0

    t0 = time.perf_counter()
    results, raw = [], {}
    for entry in entries:
        print(
            f"{entry.id} ({entry.target}, {entry.mesh}, {entry.measure})",
            file=sys.stderr,
            flush=True,
        )
        est = estimate(entry)
        raw[entry.id] = est
        results.append(evaluate(entry, est))
    table = markdown(results)
    print(table, end="")
    passed = sum(r["pass"] for r in results)
    print(f"\n{passed} of {len(results)} entries pass ({time.perf_counter() - t0:.0f} s)")

    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {**meta(), "wall_s": time.perf_counter() - t0},
        "sources": {k: dataclasses.asdict(v) for k, v in SOURCES.items()},
        "entries": [
            {
                **dataclasses.asdict(e),
                "devices": e.devices,
                "published_s": {s.name: published_seconds(e, s) for s in e.settings},
                "params": r["params"],
                "pass": r["pass"],
                "problems": r["problems"],
                "estimates": raw[e.id],
            }
            for e, r in zip(entries, results, strict=True)
        ],
        "rows": [row for r in results for row in r["rows"]],
        "pairs": [p for r in results for p in r["pairs"]],
    }
    name = "published" if not args.only else "published-" + "-".join(args.only)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (args.out / f"{name}.md").write_text(table)
    print(f"wrote {args.out / (name + '.json')} and {name}.md", file=sys.stderr)
    if args.check and passed < len(results):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
