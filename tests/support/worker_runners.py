"""A runner for worker processes in tests (``WorkerPool(runner="tests.support.worker_runners:run")``).

It runs the real :func:`ditfuse.runtime.engine.run_batch` except for prompts with a test prefix,
which make the worker wait on files in ``$DITFUSE_TEST_SYNC_DIR/<tag>/`` (processes share no
memory with the test; every wait is bounded, so a broken engine fails the test instead of
hanging it):

``barrier:<tag>:<n>:...``  touch ``barrier-<pid>``, wait until ``n`` such files exist, then run:
                           passes only if ``n`` batches run at the same time in ``n`` workers.
``hold:<tag>:...``         touch ``held-<pid>`` (the test reads which worker holds it), wait for
                           ``release``, then run.
``boom``                   raise RuntimeError (a pipeline error inside the worker).
a video (``num_frames``)   step ``num_inference_steps`` times through ``on_step``; after the first
                           step touch ``stepping-<pid>`` and wait for ``go``; return uint8 clips.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

WAIT_S = 60.0


def _dir(prompt: str) -> Path:
    tag = prompt.split(":")[1]
    d = Path(os.environ["DITFUSE_TEST_SYNC_DIR"]) / tag
    d.mkdir(parents=True, exist_ok=True)
    return d


def _wait(what: str, ok: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {os.getpid()}: waited {WAIT_S:g} s for {what}")
        time.sleep(0.005)


def run(loaded: Any, slots: Any, pad_to: int | None = None, on_step: Any = None) -> list[Any]:
    from ditfuse.runtime.engine import run_batch

    p0 = slots[0][0]
    prompt = p0.prompt
    if prompt == "boom":
        raise RuntimeError("pipeline exploded")
    if prompt.startswith("barrier:"):
        d = _dir(prompt)
        n = int(prompt.split(":")[2])
        (d / f"barrier-{os.getpid()}").touch()
        _wait(f"{n} batches at once", lambda: len(list(d.glob("barrier-*"))) >= n)
    elif prompt.startswith("hold:"):
        d = _dir(prompt)
        (d / f"held-{os.getpid()}").touch()
        _wait("release", (d / "release").exists)
    if p0.num_frames is not None:
        import numpy as np

        d = _dir(prompt)
        total = p0.num_inference_steps
        for i in range(total):
            on_step(i, total)
            if i == 0:
                (d / f"stepping-{os.getpid()}").touch()
                _wait("go", (d / "go").exists)
        return [np.zeros((p.num_frames, p.height, p.width, 3), np.uint8) for p, _ in slots]
    return run_batch(loaded, slots, pad_to=pad_to, on_step=on_step)
