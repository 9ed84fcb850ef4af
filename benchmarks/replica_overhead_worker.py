"""One rank of ``benchmarks/replica_overhead.py``: the built-in trainer plus measurements.

Run under torchrun with the built-in trainer's arguments (Megatron-LM names) and, in addition,
``--grad-reduce-in-bf16`` (Megatron-LM's flag; the built-in trainer always reduces in fp32 today).
After training, every rank writes one ``{"event": "bench", ...}`` line to its own
``<ha-log-dir>/events/rank_<R>.jsonl`` with:

- ``memory``: bytes of model params, grads, fp32 main params, fp32 main grads, exp_avg, exp_avg_sq
  that this rank *really holds*, counted over distinct storages (a main grad that is a view of an
  fp32 grad buffer is not counted twice);
- ``comm``: bytes handed to every collective per step, by phase (``grad``: inside
  finalize_model_grads; ``optimizer``: inside optimizer.step; ``other``), op and group size;
- ``phases``: median wall and CPU seconds per step inside grad sync and optimizer.step;
- ``cpu_s``: CPU seconds of the process per step after warm-up;
- ``buckets``: the live grad buckets (numel, dtype, the DP/instance group sizes) from which the
  MindSpeed full-all-reduce scheme is computed by the driver.
"""
from __future__ import annotations

import collections
import contextlib
import os
import statistics
import sys
import time

# Runnable as a plain script from a checkout: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mindspeed_ha.process  # noqa: E402,F401  (first: it notes this worker's launcher, before torch loads)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_into_tensor",
               "_all_gather_base", "all_gather", "broadcast", "reduce_scatter")


class CommCounter:
    """Wraps torch.distributed collectives (and megatron's import-time aliases of them) to count the
    bytes each call hands to the network. It only observes: arguments go through unchanged."""

    def __init__(self):
        self.phase = "other"
        self.step = 0
        self.calls = collections.defaultdict(lambda: collections.Counter())  # step -> (phase,op,n) -> bytes
        self.times = collections.defaultdict(lambda: collections.Counter())  # step -> phase.{wall,cpu} -> s

    @contextlib.contextmanager
    def in_phase(self, name: str):
        prev, self.phase = self.phase, name
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.phase = prev
            self.times[self.step][f"{name}_wall"] += time.perf_counter() - w0
            self.times[self.step][f"{name}_cpu"] += time.process_time() - c0

    def _wrap(self, name: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            n = dist.get_world_size(group)
            tensors = [a for a in args if torch.is_tensor(a)] + [v for v in kwargs.values() if torch.is_tensor(v)]
            lists = [a for a in args if isinstance(a, list) and a and torch.is_tensor(a[0])]
            if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "all_gather_into_tensor", "_all_gather_base"):
                # (output, input): the message is the full (unsharded) tensor
                size = max(t.numel() * t.element_size() for t in tensors)
            elif name in ("all_gather", "reduce_scatter"):
                size = sum(t.numel() * t.element_size() for t in lists[0]) if lists else 0
            else:
                size = tensors[0].numel() * tensors[0].element_size() if tensors else 0
            if n > 1:
                counter.calls[counter.step][(counter.phase, name, n)] += size
            return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn
        return wrapper

    def install(self) -> None:
        # megatron's param_and_grad_buffer binds reduce-scatter/all-gather at import time; rebind there too.
        from megatron.core.distributed import param_and_grad_buffer as pgb
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))
        for alias in ("dist_reduce_scatter_func", "dist_all_gather_func"):
            fn = getattr(pgb, alias)
            setattr(pgb, alias, self._wrap(self._alias_name(fn), fn))

    @staticmethod
    def _alias_name(fn) -> str:
        name = getattr(getattr(fn, "__wrapped__", fn), "__name__", "")
        if "reduce_scatter" in name:
            return "reduce_scatter_tensor"
        if "all_gather" in name:
            return "all_gather_into_tensor"
        return name

    def phase_times(self, from_step: int) -> dict:
        """Median seconds per step spent in each phase (wall and CPU)."""
        steps = [self.times[s] for s in sorted(self.times) if s >= from_step]
        keys = sorted({k for t in steps for k in t})
        return {k: statistics.median(t[k] for t in steps) for k in keys} if steps else {}

    def per_step(self, from_step: int) -> list[dict]:
        out = []
        for step in sorted(s for s in self.calls if s >= from_step):
            out.append([{"phase": p, "op": op, "group_size": n, "bytes": b}
                        for (p, op, n), b in sorted(self.calls[step].items())])
        return out


def memory_report(trainer) -> dict:
    """Bytes this rank holds for training state, by kind, over distinct storages."""
    from mindspeed_ha.replica.optimizer import inner_optimizers

    seen: set[int] = set()
    kinds = collections.Counter()
    step_bytes = 0

    def add(kind: str, t):
        if t is None:
            return
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            return  # a view of something already counted (e.g. fp32 main grad = view of fp32 grad buffer)
        seen.add(st.data_ptr())
        kinds[kind] += st.nbytes()

    numel = numel_buffers = 0
    buffers = []
    for chunk in trainer.model_chunks:
        numel += sum(p.numel() for p in chunk.parameters())
        for buf in chunk.buffers + chunk.expert_parallel_buffers:
            numel_buffers += buf.numel
            add("model_params", buf.param_data)
            add("model_grads", buf.grad_data)
            buffers.append({"numel": buf.numel, "numel_unpadded": buf.numel_unpadded,
                            "param_dtype": str(buf.param_dtype), "grad_dtype": str(buf.grad_dtype),
                            "dp_size": buf.data_parallel_world_size})
        for p in chunk.parameters():  # params outside any DDP buffer, if any
            add("model_params", p.data)
    for inner in inner_optimizers(trainer.optimizer):
        for group in inner.optimizer.param_groups:
            for main in group["params"]:
                add("main_params", main)
                add("main_grads", main.grad)
                state = inner.optimizer.state.get(main, {})
                add("exp_avg", state.get("exp_avg"))
                add("exp_avg_sq", state.get("exp_avg_sq"))
                if torch.is_tensor(state.get("step")):
                    # a scalar per tensor, not per parameter: reported apart from the per-param figure
                    step_bytes += state["step"].numel() * state["step"].element_size()
    return {"bytes": dict(kinds), "numel": numel, "numel_buffers": numel_buffers,
            "step_scalar_bytes": step_bytes, "buffers": buffers}


def grad_buckets(trainer) -> list[dict]:
    out = []
    for chunk in trainer.model_chunks:
        for bg in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            intra = bg.intra_distributed_optimizer_instance_size
            inter_group = getattr(bg, "inter_distributed_optimizer_instance_group", None)  # only with >1 instance
            inter = dist.get_world_size(inter_group) if inter_group is not None else 1
            for b in bg.buckets:
                out.append({"numel": b.grad_data.numel(), "bytes": b.grad_data.numel() * b.grad_data.element_size(),
                            "dtype": str(b.grad_data.dtype), "instance_size": intra, "instances": inter,
                            "dp_size": intra * inter})
    return out


def main(argv=None) -> int:
    from mindspeed_ha import layout, options as ha_options
    from mindspeed_ha.adaptor import apply_patches
    from mindspeed_ha.device import detect
    from mindspeed_ha.trainer.args import build_parser, finalize

    parser = build_parser()
    parser.add_argument("--bench-warmup", type=int, default=2, help="steps whose comm is not reported")
    args = parser.parse_args(argv)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = detect()
    args = finalize(args, world)
    opts = ha_options.from_args(args)
    layout.validate(world, args, opts)
    apply_patches(device, megatron_lm=False, ha=opts.enabled)  # HA off: none of our wrappers either
    device.set_current(local_rank)

    from mindspeed_ha.rank.session import RankSession
    from mindspeed_ha.trainer import builtin

    counter = CommCounter()
    cpu_s: list[float] = []
    counter.install()  # after the patches, so we count what megatron finally calls

    class BenchTrainer(builtin.BuiltinTrainer):
        def _finalize_grads(self, *fargs, **fkwargs):
            with counter.in_phase("grad"):
                return super()._finalize_grads(*fargs, **fkwargs)

        def train_step(self):
            counter.step = self.iteration + 1
            c0 = time.process_time()
            loss = super().train_step()
            # CPU seconds of this process (all threads, gloo's included) for the step: unlike wall
            # time it does not count the time other tenants of the machine hold the cores.
            cpu_s.append(time.process_time() - c0)
            return loss

    builtin.init_distributed(args.distributed_backend or device.backend, args.distributed_timeout_minutes)
    session = RankSession(opts, device, rank, world, local_rank)
    trainer = BenchTrainer(args, session)
    try:
        trainer.setup()
        step = trainer.optimizer.step

        def counted_step():
            with counter.in_phase("optimizer"):
                return step()
        trainer.optimizer.step = counted_step  # instance attribute: the optimizer's class is untouched
        trainer.train()
        from megatron.core import parallel_state as ps
        session.events.emit("bench", replica=opts.use_replica_optimizer,
                            dp_size=ps.get_data_parallel_world_size(),
                            memory=memory_report(trainer), buckets=grad_buckets(trainer),
                            comm=counter.per_step(args.bench_warmup + 1), cpu_s=cpu_s[args.bench_warmup:],
                            phases=counter.phase_times(args.bench_warmup + 1))
    finally:
        session.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
