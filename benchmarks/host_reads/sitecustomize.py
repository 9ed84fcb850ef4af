"""Counts the host reads of tensor values that mindspeed_ha's own code makes during a training step.

On a GPU each such read (``.item()``, ``float()``, ``.tolist()``, a copy to the CPU, a stream sync) is a
host sync: the host waits for the device queue to drain before it can enqueue more of the step. On
this CPU machine nothing waits, so the reads are counted where they are made: any process that has
this folder on its PYTHONPATH and ``MINDSPEED_HA_HOST_READS`` set writes, at exit, a JSON file into
that folder with the calls and the bytes read by call site, split by where in the step they came:

- ``mid_step``: from the step's start (the session's ``step_start``) to the trainer's step end — the
  span in which the step's device work is enqueued, where a read stalls it;
- ``step_end``: in the trainer's step end (``_step_done`` of the Megatron-LM trainer, ``finish_step``
  of the built-in one), where Megatron-LM's loop syncs anyway (its loss scale's ``.item()`` right
  after train_step returns).

What it cannot see: reads made in C++ (torch's or megatron-core's own), and the syncs a GPU would make
where the CPU has nothing to wait for (``commit_point`` syncs only while a collective is pending:
counted when it calls ``device.synchronize``, which on the emulated NCCL happens only where a
collective is still in flight). A test and a benchmark use it; the package does not.
"""
import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import threading

OUT = os.environ.get("MINDSPEED_HA_HOST_READS")
PKG = os.sep + "mindspeed_ha" + os.sep
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")
# module -> (class, method, the phase from its call on) ; None: the step's phase ends when it returns
MARKS = {"mindspeed_ha.rank.session": [("RankSession", "step_start", "mid_step", "after"),
                                  ("RankSession", "step_end", None, "after")],
         "mindspeed_ha.megatron_lm.trainer": [("MegatronLMTrainer", "_step_done", "step_end", "before")],
         "mindspeed_ha.trainer.builtin": [("BuiltinTrainer", "finish_step", "step_end", "before")],
         "mindspeed_ha.device": [(None, "synchronize", "sync", "count")]}

counts: dict = {"mid_step": {}, "step_end": {}, "host_memory": {}, "steps": 0}
phase = {"now": None}


# Frames that are not the caller: the CPU stand-in for CUDA (it relays Megatron's own calls here).
RELAYS = (os.sep + os.path.join("mindspeed_ha", "device", "cpu.py"),)
# Call sites that read host memory (no device sync on a GPU either), counted apart.
HOST_MEMORY = {"trainer/data.py:tokens_fingerprint": "the batch as the data loader yields it, before the "
                                                     "trainer's forward step moves it to the device"}


def _count(what: str, nbytes: int = 0, depth: int = 2) -> None:
    if phase["now"] is None or threading.current_thread() is not threading.main_thread():
        return
    f = sys._getframe(depth)
    while f is not None and (f.f_code.co_filename.endswith(RELAYS) or os.sep + "torch" + os.sep in f.f_code.co_filename):
        f = f.f_back
    if f is None or PKG not in f.f_code.co_filename:
        return
    where = f"{f.f_code.co_filename.split(PKG)[-1]}:{f.f_code.co_name}"
    d = counts["host_memory" if where in HOST_MEMORY else phase["now"]]
    calls, read = d.get(f"{where} {what}", (0, 0))
    d[f"{where} {what}"] = (calls + 1, read + nbytes)


def _wrap_read(name: str) -> None:
    import torch
    orig = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        _count(name, self.numel() * self.element_size())
        return orig(self, *args, **kwargs)
    setattr(torch.Tensor, name, read)


def _mark(owner, method: str, to, when: str) -> None:
    orig = getattr(owner, method)

    def marked(*args, **kwargs):
        if when == "count":
            _count("device.synchronize")
            return orig(*args, **kwargs)
        if when == "before":
            phase["now"] = to
        out = orig(*args, **kwargs)
        if when == "after":
            phase["now"] = to
            if to == "mid_step":
                counts["steps"] += 1
        return out
    setattr(owner, method, marked)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches the marked modules as they are imported."""

    def find_spec(self, name, path, target=None):
        if name not in MARKS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._loaders = getattr(self, "_loaders", {})
        self._loaders[name] = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        self._loaders[module.__name__].exec_module(module)
        for cls, method, to, when in MARKS[module.__name__]:
            owner = module if cls is None else getattr(module, cls, None)
            if owner is not None and hasattr(owner, method):
                _mark(owner, method, to, when)


def _write() -> None:
    if counts["steps"]:
        with open(os.path.join(OUT, f"{os.getpid()}.json"), "w") as f:
            json.dump(counts, f)


if OUT:
    import torch  # noqa: F401  (before any mindspeed_ha module: its reads are the ones wrapped)
    for _name in READS:
        _wrap_read(_name)
    sys.meta_path.insert(0, _AfterImport())
    atexit.register(_write)
