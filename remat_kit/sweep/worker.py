"""A worker process of the local engine (:class:`remat_kit.sweep.engine.LocalEngine`):
``python .../remat_kit/sweep/worker.py``, started by the driver with its own environment (the
devices it may use: ``CUDA_VISIBLE_DEVICES``; ``JAX_PLATFORMS=cpu`` for analysis-only tasks).
Run as a file, it imports the standard library alone until the driver's runner and tasks
need more (their modules are imported as they are unpickled).

It talks to the driver in pickles: on standard input it reads the driver's ``sys.path`` (so it
imports the driver's modules), then a factory of task runners, then ``(task id, task)`` pairs
until ``None`` or the end of the input; on what was its standard output it writes ``("ready",
None, None)`` once the runner is made, then per task ``("done", id, rows)`` or ``("failed",
id, message)``. Anything else the process prints goes to standard error (file descriptor 1 is
pointed there), so no stray line can corrupt the channel.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run as a file: its folder's modules (config, run...) are no top-level names


def main() -> int:
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # print() and C++ logs go to standard error from here on
    sys.stdout = sys.stderr
    inbox = sys.stdin.buffer

    def send(*message) -> None:
        pickle.dump(message, channel, protocol=pickle.HIGHEST_PROTOCOL)
        channel.flush()

    try:
        paths = pickle.load(inbox)
        sys.path[:0] = [p for p in paths if p not in sys.path]
        runner = pickle.load(inbox)()
    except EOFError:
        return 0
    send("ready", None, None)
    while True:
        try:
            message = pickle.load(inbox)
        except EOFError:
            return 0
        if message is None:
            return 0
        task_id, task = message
        try:
            rows = runner(task, None)
        except Exception as err:  # a failure outside the points' own handling: the task's rows
            traceback.print_exc()
            first = (str(err).splitlines() or [""])[0]
            send("failed", task_id, f"{type(err).__name__}: {first}".rstrip(": "))
            continue
        send("done", task_id, rows)


if __name__ == "__main__":
    sys.exit(main())
