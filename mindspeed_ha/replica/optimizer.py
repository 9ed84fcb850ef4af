"""ReplicaOptimizer: megatron-core's (partial) DistributedOptimizer plus what recovery needs.

An optimizer instance keeps its class and behaviour; its ``__class__`` becomes a subclass that adds:
a stable description of the shard, export/import of the shard state (fp32 main params and whatever
the torch optimizer keeps for them, in its own layout: ``replica.state``; the step count per
parameter or per group; the loss scaler) as plain tensors for point-to-point transfer, a fingerprint
of that state, and the shard's iteration plus an "update in progress" mark around the optimizer
step. ``isinstance`` checks in Megatron keep working because the class is a subclass of the
original. (The methods are copied into that subclass rather than mixed in: CPython 3.11 refuses a
``__class__`` swap onto a class whose first base is a mixin, "object layout differs".)

The loss scaler (fp16's dynamic one) belongs to the shard's iteration: it changes as the update
begins (megatron-core unscales the gradients and updates it before the arithmetic), so an update
abandoned before the arithmetic (``ha_abandon_update``) puts it back, and a twin's shard carries it.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from mindspeed_ha import compat
from mindspeed_ha.device import current
from mindspeed_ha.replica import state
from mindspeed_ha.replica.topology import ReplicaTopology

if TYPE_CHECKING:
    from mindspeed_ha.replica.reshard import Range

def inner_optimizers(opt: Any) -> list[Any]:
    """The DistributedOptimizers inside a (possibly chained) megatron optimizer."""
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def param_names(inner: Any) -> dict[torch.nn.Parameter, str]:
    """Each model parameter of megatron's optimizer ``inner`` -> the name its data-parallel peers give
    the same tensor: its module path, after ``model1.`` and so on for an interleaved pipeline's chunks
    (which repeat the first one's paths, as in a checkpoint). An expert's path numbers it within its
    expert-parallel rank, which the parameter's position (``ha_param_positions``) carries. The
    engine's own names, the same in every megatron-core release (megatron's ``_param_name`` is not
    in 0.12 and 0.13, and numbers experts job-wide from 0.16)."""
    names: dict[torch.nn.Parameter, str] | None = getattr(inner, "_ha_param_names", None)
    if names is None:
        chunks = inner.model_chunks
        names = inner._ha_param_names = {
            p: (f"model{i}.{n}" if len(chunks) > 1 else n)
            for i, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    return names


def _gathers_in_step(chained: Any, inners: list[Any]) -> bool:
    """Each inner optimizer all-gathers its parameters inside its step (megatron-core's
    DistributedOptimizer without overlapped or FSDP parameter gathers)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    if getattr(chained.config, "overlap_param_gather_with_optimizer_step", False):
        return False
    return all(isinstance(o, DistributedOptimizer) and not o.ddp_config.overlap_param_gather
               and not getattr(o.ddp_config, "use_megatron_fsdp", False) for o in inners)


def set_step_counts(optimizer: Any, step: float | None = None) -> None:
    """Every inner optimizer's step count := ``step`` (None: the one its param groups hold, as a
    checkpoint load leaves it), where that optimizer keeps one (``replica.state.set_step_count``)."""
    for inner in inner_optimizers(optimizer):
        state.set_step_count(inner.optimizer, state.layout_of(inner.optimizer), step)


def step_count(optimizer: Any) -> float | None:
    """The step count every inner optimizer shares (None: an optimizer without one, SGD)."""
    for inner in inner_optimizers(optimizer):
        return state.step_count(inner.optimizer, state.layout_of(inner.optimizer))
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same memory (a view of the live state, written in place)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def _scaler_state(inner: Any) -> dict[str, Any]:
    scaler = getattr(inner, "grad_scaler", None)
    return dict(scaler.state_dict()) if scaler is not None and hasattr(scaler, "state_dict") else {}


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
        # each inner optimizer's state layout (refused here, before training, if unknown)
        self._ha_layouts = [state.layout_of(inner.optimizer) for inner in inner_optimizers(self)]
        self._ha_scalers_at_start: list[dict[str, Any]] = []

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

    def ha_scaler_states(self) -> list[dict[str, Any]]:
        """Each inner optimizer's loss scaler, as plain numbers (what a resize carries over)."""
        return [{k: (v.item() if torch.is_tensor(v) else v) for k, v in _scaler_state(i).items()}
                for i in inner_optimizers(self)]

    def ha_install_scaler_states(self, states: list[dict[str, Any]] | None) -> None:
        for inner, saved in zip(inner_optimizers(self), states or []):
            mine = _scaler_state(inner)
            if saved and mine:
                inner.grad_scaler.load_state_dict(
                    {k: (mine[k].new_tensor(v) if torch.is_tensor(mine[k]) else v) for k, v in saved.items()})

    def ha_abandon_update(self) -> None:
        """Close an update window stopped before its arithmetic began: the shard is still at
        ``ha_iteration``, and so is the loss scaler again (megatron-core had updated it already)."""
        if self.ha_updating and not self.ha_touched:
            for inner, saved in zip(inner_optimizers(self), self._ha_scalers_at_start):
                if saved:
                    inner.grad_scaler.load_state_dict(saved)
        self.ha_updating = False

    def step(self) -> Any:
        target = self.ha_iteration + 1
        self.ha_updating, self.ha_touched = True, False
        self.ha_grad_stats = [None, None]  # (grad norm, zeros in grad) of this update, once computed
        self._ha_scalers_at_start = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in _scaler_state(i).items()}
                                     for i in inner_optimizers(self)]
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
        from mindspeed_ha.comm.interruptible import PROCESS_STOP
        try:
            PROCESS_STOP.commit_point("the optimizer update")
        except Exception:
            self.ha_grad_stats = [None, None]
            raise
        # From here to the parameter all-gather the update is local arithmetic, which a stop cannot
        # interrupt, so a rank stopped in its window either never touched its shard (still at
        # ha_iteration) or will finish the update (the dump relies on this).
        self.ha_touched = True
        inners = inner_optimizers(self)
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
        for o, inner in enumerate(inner_optimizers(self)):
            model_groups = [a + b for a, b in zip(inner.model_float16_groups, inner.model_fp32_groups)]
            for g, group in enumerate(inner.optimizer.param_groups):
                for i, main in enumerate(group["params"]):
                    yield f"o{o}.g{g}.p{i}", main, model_groups[g][i], inner

    def ha_shard_description(self) -> list[dict[str, Any]]:
        desc = []
        for name, main, model_param, inner in self._ha_entries():
            rng = compat.param_range(inner, model_param)  # type: ignore[no-untyped-call]  # compat's gate is untyped
            desc.append({"name": name, "param": param_names(inner)[model_param],
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
                for inner in inner_optimizers(self) for p, name in param_names(inner).items()}

    def ha_state_ranges(self) -> dict[Range, tuple[torch.Tensor, ...]]:
        """This shard in parameter coordinates, what a reshard moves: ((position, parameter name),
        start, end) -> (main values, then the optimizer's elementwise state: exp_avg and exp_avg_sq,
        or SGD's momentum) of those flattened elements, in fp32: live views where the optimizer keeps
        them so, else copies (``replica.state.reshard_values``) that ``ha_install_state_ranges`` writes
        back once the new values are in. The step count is not here: every entry shares its value."""
        self.ha_ensure_state()
        where = {name: position for name, (_, position) in self.ha_param_positions().items()}
        layouts = dict(zip(map(id, inner_optimizers(self)), self._ha_layouts))
        out: dict[Range, tuple[torch.Tensor, ...]] = {}
        for _, main, model_param, inner in self._ha_entries():
            name = param_names(inner)[model_param]
            rng = compat.param_range(inner, model_param)  # type: ignore[no-untyped-call]  # compat's gate is untyped
            out[((where[name], name), rng.start, rng.end)] = state.reshard_values(inner.optimizer, layouts[id(inner)],
                                                                                  main)
        return out

    def ha_install_state_ranges(self, ranges: dict[Range, tuple[torch.Tensor, ...]]) -> None:
        """After a reshard wrote into ``ranges`` (this optimizer's ``ha_state_ranges``): the copies
        among them back into the optimizer's own state."""
        layouts = dict(zip(map(id, inner_optimizers(self)), self._ha_layouts))
        for (_, main, _, inner), values in zip(self._ha_entries(), ranges.values()):
            state.reshard_install(inner.optimizer, layouts[id(inner)], main, values)

    def ha_ensure_state(self) -> None:
        """Allocate the optimizer's state (a newcomer's optimizer has none until its first step):
        Adam's moments (and torch's per-parameter step), SGD's momentum where it has momentum."""
        for inner, layout in zip(inner_optimizers(self), self._ha_layouts):
            if not inner.optimizer.state and layout is not state.SGD:
                compat.init_optimizer_state(inner)
            if layout is state.SGD:
                for group in inner.optimizer.param_groups:
                    if group.get("momentum"):
                        for p in group["params"]:
                            st = inner.optimizer.state[p]
                            if st.get("momentum_buffer") is None:
                                # (zeros: torch's first SGD step then gives the buffer the gradient,
                                # as it does starting from none, with dampening 0)
                                st["momentum_buffer"] = torch.zeros_like(p)
            state.own_step_tensors(inner.optimizer, layout)

    def ha_export_shard(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Views of the live shard state, in a stable order; send them, don't mutate them: per
        parameter its main values and optimizer state (with scales), per inner optimizer its
        per-group step counts (fused Adam) and its loss scaler."""
        out: "collections.OrderedDict[str, torch.Tensor]" = collections.OrderedDict()
        layouts = dict(zip(map(id, inner_optimizers(self)), self._ha_layouts))
        for name, main, _, inner in self._ha_entries():
            out[f"{name}.param"] = main.detach()
            state.export_param(inner.optimizer, layouts[id(inner)], main, name, out)
        for o, inner in enumerate(inner_optimizers(self)):
            state.export_groups(inner.optimizer, layouts[id(inner)], f"o{o}", out, current())
            for k, v in sorted(_scaler_state(inner).items()):
                out[f"o{o}.grad_scaler.{k}"] = (v.detach() if torch.is_tensor(v)
                                                else torch.tensor(v, dtype=torch.float64, device=current()))
        return out

    def ha_import_shard(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite this rank's shard with ``tensors`` (from ``ha_export_shard`` of a replica)."""
        self.ha_ensure_state()
        layouts = dict(zip(map(id, inner_optimizers(self)), self._ha_layouts))
        with torch.no_grad():
            for name, main, _, inner in self._ha_entries():
                if not _same(main, tensors[f"{name}.param"]):  # (a repair wrote into the live shard itself)
                    main.copy_(tensors[f"{name}.param"])
                state.import_param(inner.optimizer, layouts[id(inner)], main, name, tensors)
            for o, inner in enumerate(inner_optimizers(self)):
                state.import_groups(inner.optimizer, layouts[id(inner)], f"o{o}", tensors)
                mine = _scaler_state(inner)
                if mine:
                    got = {k: tensors[f"o{o}.grad_scaler.{k}"] for k in mine if f"o{o}.grad_scaler.{k}" in tensors}
                    inner.grad_scaler.load_state_dict(
                        {k: (v.to(mine[k].device, mine[k].dtype) if torch.is_tensor(mine[k]) else type(mine[k])(v.item()))
                         for k, v in got.items()})

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

    def ha_fingerprint(self) -> tuple[list[str], torch.Tensor]:
        """Every shard tensor's name and a 64-bit digest of its bytes, computed where the shard lives
        (``replica.digest``: no copy of the shard leaves the device); any flipped bit changes it."""
        from mindspeed_ha.replica.digest import digest
        shard = self.ha_export_shard()
        return list(shard), torch.stack([digest(t, current()) for t in shard.values()])


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
