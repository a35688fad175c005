"""dalle.train: a training run in this process, as the dalle-train* tools run it."""
import json
import os
import signal
import threading

from . import _dalle
from ._config import assignments

TRAINERS = ("prior", "vae", "clip", "superres")


class _MetricsTail:
    """Calls `on_metrics` with each line the run appends to its metrics.jsonl, from a thread
    that polls the file while the run holds this one (lines there before the call are skipped:
    a resumed run reports its new updates)."""

    def __init__(self, path, on_metrics, seconds):
        self.path, self.on_metrics, self.seconds = path, on_metrics, seconds
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _deliver(self):
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            for line in file:
                if not line.endswith(b"\n"):
                    break  # written half: the next poll takes it whole
                self.offset += len(line)
                self.on_metrics(json.loads(line))

    def _run(self):
        while not self.done.wait(self.seconds):
            self._deliver()

    def stop(self):
        self.done.set()
        self.thread.join()
        self._deliver()


def train(config, out, *, trainer="prior", overrides=None, on_metrics=None, poll_seconds=0.5):
    """Trains the recipe `config` (a YAML file) into the run directory `out`, resuming it when it
    holds a checkpoint, in this process: the same run, checkpoints and metrics.jsonl as the
    tool's. trainer names the tool: "prior" (dalle-train; `kind: bart_prior` picks the BART
    prior), "vae" (dalle-train-vae; `kind: vqgan`), "clip" (dalle-train-clip) or "superres"
    (dalle-train-sr). overrides set recipe keys ({"run.steps": 100} or {"run": {"steps": 100}}).
    on_metrics(dict) is called with each metrics line as the run writes it, from a watcher
    thread (the GIL is released while the run trains).

    Ctrl-C stops the run after writing a checkpoint and raises KeyboardInterrupt; calling again
    resumes. Several ranks are the launchers' (dalle-train --nproc-per-node N, torchrun).
    Returns {"run": out, "finished": whether every update was made}."""
    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {', '.join(TRAINERS)}, not {trainer!r}")
    if not out:
        raise ValueError("out: the run directory is required")
    tail = None if on_metrics is None else _MetricsTail(os.path.join(out, "metrics.jsonl"), on_metrics, poll_seconds)
    try:
        finished, stopped_by = _dalle.train("" if config is None else str(config), str(out), assignments(overrides),
                                            trainer)
    finally:
        if tail:
            tail.stop()
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt(f"training stopped: a checkpoint is in {out}; train again to resume")
    return {"run": str(out), "finished": finished}
