"""ReplicaOptimizer: megatron-core's (partial) DistributedOptimizer plus what recovery needs.

An optimizer instance keeps its class and behaviour; its ``__class__`` becomes a subclass that adds:
a stable description of the shard, export/import of the shard state (fp32 main params, exp_avg,
exp_avg_sq, step) as plain tensors for point-to-point transfer, a fingerprint of that state, and the
shard's iteration plus an "update in progress" mark around the optimizer step. ``isinstance`` checks
in Megatron keep working because the class is a subclass of the original. (The methods are copied
into that subclass rather than mixed in: CPython 3.11 refuses a ``__class__`` swap onto a class whose
first base is a mixin, "object layout differs".)
"""
from __future__ import annotations

import collections
import hashlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from mindspeed_ha import compat
from mindspeed_ha.replica.topology import ReplicaTopology

if TYPE_CHECKING:
    from mindspeed_ha.replica.reshard import Range

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _inner_optimizers(opt: Any) -> list[Any]:
    """The DistributedOptimizers inside a (possibly chained) megatron optimizer."""
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def _gathers_in_step(chained: Any, inners: list[Any]) -> bool:
    """Each inner optimizer all-gathers its parameters inside its step (megatron-core's
    DistributedOptimizer without overlapped or FSDP parameter gathers)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    if getattr(chained.config, "overlap_param_gather_with_optimizer_step", False):
        return False
    return all(isinstance(o, DistributedOptimizer) and not o.ddp_config.overlap_param_gather
               and not getattr(o.ddp_config, "use_megatron_fsdp", False) for o in inners)


def set_adam_steps(optimizer: Any, step: float | None = None) -> None:
    """Give every parameter its own Adam ``step`` tensor (``step``, or its group's count when None),
    where torch's Adam keeps it: on the parameter's device for a capturable or fused update, else a
    CPU scalar (on a GPU too)."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.optimizer.param_groups:
            on_device = bool(group.get("capturable") or group.get("fused"))
            for p in group["params"]:
                state = inner.optimizer.state.get(p)
                if state is not None:
                    value = step if step is not None else group.get("step", state.get("step"))
                    state["step"] = torch.tensor(float(value), dtype=torch.float32,
                                                 device=p.device if on_device else "cpu")


class ReplicaMixin:
    ha_topology: "ReplicaTopology"
    _ha_base: type[Any]  # the megatron class this replica class extends

    # -- update window ---------------------------------------------------------------------------
    def ha_attach(self, topology: ReplicaTopology, iteration: int = 0) -> None:
        self.ha_topology = topology
        self.ha_iteration = iteration
        self.ha_updating = False
        self.ha_touched = False  # inside the window: has the shard's arithmetic begun?
        self.ha_grad_stats: list[float | None] = [None, None]
        self._ha_listeners: list[Callable[[str, int], None]] = []

    def ha_add_listener(self, fn: Callable[[str, int], None]) -> None:
        """fn(event, iteration) with event in {"update_start", "update_end"}."""
        self._ha_listeners.append(fn)

    def _ha_notify(self, event: str, iteration: int) -> None:
        for fn in list(getattr(self, "_ha_listeners", ())):
            fn(event, iteration)

    def ha_mark_update_end(self) -> None:
        """Called when this rank's shard has its new values (before the parameter all-gather)."""
        if self.ha_updating:
            self.ha_updating = False
            self.ha_iteration += 1
            self._ha_notify("update_end", self.ha_iteration)

    def step(self) -> Any:
        target = self.ha_iteration + 1
        self.ha_updating, self.ha_touched = True, False
        self.ha_grad_stats = [None, None]  # (grad norm, zeros in grad) of this update, once computed
        self._ha_notify("update_start", target)
        result = self._ha_base.step(self)
        self.ha_mark_update_end()  # no-op if the param-sync hook already marked it
        return result

    # What step() returns, kept as it is computed: a roll-forward recovery reports the update a
    # fault interrupted after these (e.g. in the parameter all-gather) without redoing it.
    def get_grad_norm(self) -> float:
        norm: float = self._ha_base.get_grad_norm(self)
        self.ha_grad_stats[0] = norm
        return norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        norm: float = self._ha_base.clip_grad_norm(self, clip_grad)
        self.ha_grad_stats[0] = norm
        return norm

    def count_zeros(self) -> float:
        zeros: float = self._ha_base.count_zeros(self)
        self.ha_grad_stats[1] = zeros
        return zeros

    def step_with_ready_grads(self) -> bool:
        # The commit point: the update reads reduced gradients, their norm and found-inf, so it runs
        # only if their collectives completed before any stop's abort (a stream-ordered backend's
        # aborted collectives return partial results, and no error). Refused, the shard stays at
        # ha_iteration, untouched, and the grad statistics computed from those results are dropped.
        from mindspeed_ha.comm.interruptible import commit_point
        try:
            commit_point("the optimizer update")
        except Exception:
            self.ha_grad_stats = [None, None]
            raise
        # From here to the parameter all-gather the update is local arithmetic, which a stop cannot
        # interrupt, so a rank stopped in its window either never touched its shard (still at
        # ha_iteration) or will finish the update (the dump relies on this).
        self.ha_touched = True
        inners = _inner_optimizers(self)
        if len(inners) == 1 or not _gathers_in_step(self, inners):
            ready: bool = self._ha_base.step_with_ready_grads(self)
            return ready
        # A chained optimizer (dense and expert parameters: MoE) lets each inner optimizer update its
        # shard and then all-gather the parameters, the next one after: a stop in the first all-gather
        # would leave the dense part of this rank's shard updated and the expert part not, an iteration
        # no twin holds. Every local update first, then the same all-gathers: the shard is whole
        # before any collective can stop the rank.
        from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
        ok = True
        for opt in inners:
            ok &= bool(MixedPrecisionOptimizer.step_with_ready_grads(opt))
        for opt in inners:
            for chunk in opt.model_chunks:
                chunk.start_param_sync()
        return ok

    # -- shard state -----------------------------------------------------------------------------
    def _ha_entries(self) -> Iterator[tuple[str, torch.Tensor, torch.nn.Parameter, Any]]:
        """(name, main_param, model_param, inner_optimizer) in a stable order."""
        for o, inner in enumerate(_inner_optimizers(self)):
            model_groups = [a + b for a, b in zip(inner.model_float16_groups, inner.model_fp32_groups)]
            for g, group in enumerate(inner.optimizer.param_groups):
                for i, main in enumerate(group["params"]):
                    yield f"o{o}.g{g}.p{i}", main, model_groups[g][i], inner

    def ha_shard_description(self) -> list[dict[str, Any]]:
        desc = []
        for name, main, model_param, inner in self._ha_entries():
            rng = compat.param_range(inner, model_param)  # type: ignore[no-untyped-call]  # compat's gate is untyped
            desc.append({"name": name, "param": compat.param_name(inner, model_param),
                         "shape": list(model_param.shape), "start": rng.start, "end": rng.end,
                         "dtype": str(main.dtype)})
        return desc

    def ha_param_positions(self) -> dict[str, tuple[torch.nn.Parameter, tuple[str | int, ...]]]:
        """Parameter name -> (parameter, position): DP peers hold the same tensor at the same
        position (dense: TP and PP rank; expert: expert-TP, EP and PP rank)."""
        from megatron.core import parallel_state as ps
        dense = ("dense", ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
        expert = ("expert", ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank(),
                  ps.get_pipeline_model_parallel_rank())
        return {name: (p, dense if getattr(p, "allreduce", True) else expert)
                for inner in _inner_optimizers(self) for p, name in compat.param_names(inner).items()}

    def ha_state_ranges(self) -> dict[Range, tuple[torch.Tensor, ...]]:
        """This shard in parameter coordinates, what a reshard moves: ((position, parameter name),
        start, end) -> (main values, exp_avg, exp_avg_sq) of those flattened elements (live views:
        copy into them to install). ``step`` is not here: every entry shares its value."""
        self.ha_ensure_state()
        where = {name: position for name, (_, position) in self.ha_param_positions().items()}
        out: dict[Range, tuple[torch.Tensor, ...]] = {}
        for _, main, model_param, inner in self._ha_entries():
            name = compat.param_name(inner, model_param)
            rng = compat.param_range(inner, model_param)  # type: ignore[no-untyped-call]  # compat's gate is untyped
            st = inner.optimizer.state[main]
            out[((where[name], name), rng.start, rng.end)] = (main, st["exp_avg"], st["exp_avg_sq"])
        return out

    def ha_ensure_state(self) -> None:
        """Allocate Adam state (a newcomer's optimizer has none until its first step)."""
        for inner in _inner_optimizers(self):
            if not inner.optimizer.state:
                compat.init_optimizer_state(inner)
            for group in inner.optimizer.param_groups:
                for p in group["params"]:
                    st = inner.optimizer.state.get(p)
                    if st is not None and "step" in st:
                        st["step"] = st["step"].detach().clone()  # never share one step tensor

    def ha_export_shard(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Views of the live shard state, in a stable order; send them, don't mutate them."""
        out = collections.OrderedDict()
        for name, main, _, inner in self._ha_entries():
            out[f"{name}.param"] = main.detach()
            st = inner.optimizer.state.get(main, {})
            for k in STATE_KEYS:
                if k in st:
                    v = st[k]
                    out[f"{name}.{k}"] = v.detach() if torch.is_tensor(v) else torch.tensor(float(v), device="cpu")
        return out

    def ha_import_shard(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite this rank's shard with ``tensors`` (from ``ha_export_shard`` of a replica)."""
        self.ha_ensure_state()
        with torch.no_grad():
            for name, main, _, inner in self._ha_entries():
                main.copy_(tensors[f"{name}.param"])
                st = inner.optimizer.state.setdefault(main, {})
                for k in STATE_KEYS:
                    key = f"{name}.{k}"
                    if key in tensors:
                        if k in st and torch.is_tensor(st[k]):
                            st[k].copy_(tensors[key])
                        else:
                            st[k] = tensors[key].detach().clone()

    def ha_corrupt(self, bit_flip: bool = False) -> str:
        """Fault drills: poison this rank's shard as an uncorrectable memory error would (NaN in the
        first main-param tensor), or flip one bit silently (what the replica check must catch)."""
        name, tensor = next(iter(self.ha_export_shard().items()))
        with torch.no_grad():
            if bit_flip:
                raw = tensor.view(-1)[:1].view(torch.uint8)
                raw[0] ^= 1
            else:
                tensor.view(-1)[: max(1, tensor.numel() // 2)] = float("nan")
        return name

    def ha_fingerprint(self) -> "collections.OrderedDict[str, int]":
        """A 63-bit digest of every shard tensor's bytes (bit-exact: any flipped bit changes it)."""
        out = collections.OrderedDict()
        for key, t in self.ha_export_shard().items():
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[key] = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
        return out


_classes: dict[type, type] = {}


def make_replica(optimizer: Any, topology: ReplicaTopology, iteration: int = 0) -> Any:
    """Turn a megatron-core (Chained/)DistributedOptimizer into a ReplicaOptimizer in place."""
    cls = type(optimizer)
    if not is_replica(optimizer):
        if cls not in _classes:
            methods = {k: v for k, v in vars(ReplicaMixin).items() if not k.startswith("__")}
            _classes[cls] = type(f"Replica{cls.__name__}", (cls,), {**methods, "_ha_base": cls})
        optimizer.__class__ = _classes[cls]
    optimizer.ha_attach(topology, iteration)
    return optimizer


def is_replica(optimizer: object) -> bool:
    return "_ha_base" in vars(type(optimizer))
