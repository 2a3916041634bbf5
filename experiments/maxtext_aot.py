"""MaxText's own AOT compile (``train_compile.main``, run as is) and its compiled object's memory
figures, which its printout leaves ``peak_memory_in_bytes`` out of (docs/results/maxtext.md).

Command: ``python experiments/maxtext_aot.py KEY=VALUE ... compile_topology=v5p-8
compile_topology_num_slices=1`` (maxtext installed; ~1-2 min per config on a 2-core CPU).
"""

import json
import sys

from maxtext.trainers.pre_train import train_compile

FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "peak_memory_in_bytes")  # fmt: skip


def main(argv: list[str]) -> None:
    got = {}
    compile_step = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        got["compiled"] = compile_step(*args, **kwargs)
        return got["compiled"]

    train_compile.jit_and_compile = keep  # MaxText's own path; the compiled object kept
    train_compile.main(["train_compile.py", *argv])
    stats = got["compiled"].memory_analysis()
    print("MAXTEXT_AOT", json.dumps({f: getattr(stats, f) for f in FIELDS}))


if __name__ == "__main__":
    main(sys.argv[1:])
