"""A fault's way through a rank, read top to bottom in ``FaultLoop.recover``:

    raised       the step (or a save) raises; a stop the controller asked for is no fault of this rank
    reported     classified (memory, comm, other) and sent to the controller at once; a device whose
                 context is lost ends the process here (its twin serves its shard)
    orders       the training thread parks and waits for the controller's next order
    served       each order runs here, on the training thread (rank.recovery.handlers)
    resumed      ``resume`` ends the loop: the trainer runs on (or its recovery finishes the step)

``survive`` wraps a trainer's step in that loop; ``join`` is a restarted worker's way in (no fault:
its orders bring it into the running job).
"""
from __future__ import annotations

import contextlib
import time
import traceback
from typing import Any, Callable, Iterator

from mindspeed_ha.comm.stop import CollectiveStopped, as_stop
from mindspeed_ha.events import get_logger
from mindspeed_ha.faults import fault_kind, process_fatal
from mindspeed_ha.rank.state import RankState

log = get_logger("session")


class FaultLoop:
    """The training thread's loop from a fault to the resume, on the rank's state (its processor
    receives the orders; its stop is cleared by them)."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self.serving = False  # this (training) thread serves a recovery's orders: a step it ends is a roll-forward

    def survive(self, attempt: Callable[[], Any], iteration_of: Callable[[], int],
                after_recovery: Callable[[], Any] | None = None) -> Any:
        """Run ``attempt()`` until it returns. An exception is a fault of this rank: ``recover`` runs;
        once repaired in place, ``after_recovery()`` may give the result (a step the recovery finished),
        else ``attempt`` runs again. ``iteration_of()``: the iteration in flight. What cannot be
        recovered in place (a replica mismatch, a controller gone silent) is raised."""
        from mindspeed_ha.replica.verify import ReplicaMismatchError
        while True:
            try:
                return attempt()
            except ReplicaMismatchError:
                raise
            except Exception as raised:
                e = self._stop_or(raised)
                if not isinstance(e, CollectiveStopped):  # a stopped rank is not a fault of its own
                    traceback.print_exc()
                if not self.recover(e, iteration_of()):
                    raise
            out = after_recovery() if after_recovery is not None else None
            if out is not None:
                return out

    def _stop_or(self, exc: BaseException) -> BaseException:
        """A communication error raised once this rank's stop aborted its communicators is that stop
        (torch raises from a wait on an aborted communicator, or rethrows its watchdog's error), never
        a fault of this rank; any other error (its own memory error) is what it says."""
        return as_stop(self.state.stop, exc) if fault_kind(exc) == "comm-failure" else exc

    def recover(self, exc: BaseException, iteration: int) -> bool:
        """Raised, reported, orders, served, resumed: True once training resumes in place; False if the
        controller goes silent (or there is no control plane). An ``exit`` order ends the process from
        the processor thread."""
        st = self.state
        st.pipeline_iteration = None  # (a recovery's own point-to-point moves are no pipeline drill points)
        if st.processor is None:
            return False
        st.stopped_at = time.monotonic()
        self._report(exc, iteration)
        wait = st.options.orders_wait_s()
        if self._serve_until_resumed(wait):
            return True
        log.error("rank %d: no order from the controller for %.0f s after the fault", st.rank, wait)
        return False

    def _report(self, exc: BaseException, iteration: int) -> None:
        st = self.state
        if process_fatal(exc):
            st.end_for_lost_device(exc, iteration)
        st.device_ready(iteration)
        if fault_kind(exc) == "memory-error":
            from mindspeed_ha import device
            if not device.memory_error_repairable():
                st.end_for_lost_device(exc, iteration)
        if isinstance(exc, CollectiveStopped):  # we stopped it ourselves: not a new fault
            never = exc.never_entered
            log.info("rank %d left its collective in iteration %d (%s): stopped by the controller%s",
                     st.rank, iteration, st.phase, f" (rank(s) {never} never entered it)" if never else "")
            st.events.emit("left_collective", iteration=iteration, phase=st.phase,
                           **({"never_entered": never} if never else {}))
            st.report_left()
        else:
            kind = fault_kind(exc)
            st.report(kind, exc, iteration, st.phase)
            log.error("rank %d: %s fault in iteration %d (%s): %s", st.rank, kind, iteration, st.phase, exc)

    def _serve_until_resumed(self, wait: float) -> bool:
        """Serve orders until ``resume`` (True), or until none came for ``wait`` seconds while the
        controller was not in a recovery (False)."""
        processor = self.state.processor
        assert processor is not None and processor.link is not None  # (started with the session's processor)
        with self._serving():
            quiet = time.monotonic()
            while True:
                action = processor.serve_order(timeout=1.0)
                if action == "resume":
                    return True
                now = time.monotonic()
                # Each order restarts the clock, and so does a live controller in a recovery: one of its
                # rounds may wait out a hung rank or a restart, longer than this. A lost one's standby
                # has the same time to take over.
                if action is not None or processor.link.recovering:
                    quiet = now
                elif now - quiet > wait:
                    return False

    def join(self, until: tuple[str, ...]) -> None:
        """A restarted worker (its trainer set on the state, its processor started): serve the
        controller's orders until one of ``until`` (``rebuild`` or ``scale-out`` builds the groups and
        the trainer, ``repair`` brings the state from the peers, ``rollback``/``resume`` as everywhere)."""
        st = self.state
        assert st.processor is not None
        wait = st.options.orders_wait_s(joining=True)
        with self._serving():
            while True:
                action = st.processor.serve_order(timeout=wait)
                if action == "resume":
                    st.joining = False
                if action in until:
                    return
                if action is None:
                    raise RuntimeError(f"rank {st.rank}: restarted, but no order from the controller for "
                                       f"{wait:.0f} s")

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """This (training) thread serves a recovery's orders: a step it ends here is a roll-forward."""
        self.serving = True
        try:
            yield
        finally:
            self.serving = False
            self.state.stop.left_recovery()
