"""A rank's orders: each taken once, run where it must, answered.

``stop``, ``standby``, ``takeover`` and ``reconnect`` run on the processor thread at once (they must
work while the training thread is blocked in a collective); the recovery's orders wait for the
training thread, parked after a fault (``serve_order``); a handler that only records something may
run at once too (``at_once``: it takes effect before any order sent after it); the rest run on a
handler thread, so heartbeats go on meanwhile. A handler returns its answer (any msgpack tree, or a ``Later``) or
raises: the exception is the failed answer.

An order's arguments may carry ``then``: [action, its arguments], an order of the same thread run
right after it (the controller plays two rounds as one, ``policy.rounds``). The answer is both
answers, in a list; if the first fails, that is the answer and the second is not run.
"""
from __future__ import annotations

import collections
import os
import queue
import sys
from typing import Any, Callable, ContextManager, Mapping

from ...control.wire import protocol
from ...events import get_logger
from ...faults import fault_kind
from .held import HeldWatch

log = get_logger("control.processor")
# An order's handler: its arguments -> its answer (a msgpack tree, or a Later).
Handler = Callable[[dict[str, Any]], object]


class Later:
    """A handler's answer that is sent after the handler returns: the training loop has to run on
    first (a newcomer of Megatron-LM's loop builds its model before it can finish a scale-out).
    ``finish(fn)`` runs the rest and answers with its result (or its exception)."""

    def __init__(self) -> None:
        self._send: Callable[..., None] | None = None

    def finish(self, fn: Callable[[], object]) -> bool:
        assert self._send is not None  # (set when the handler that made it returned)
        try:
            data = fn()
        except Exception as e:
            log.exception("the rest of a handler failed")
            self._send(False, error=f"{type(e).__name__}: {e}")
            return False
        self._send(True, data=data)
        return True


class Orders:
    """The handlers, the two queues and the answers. ``inline``: the processor's own orders (run on its
    thread); ``send(frame)``: an answer to the controller, from any thread; ``awaiting()``: the rank's
    stop's ``awaiting_orders`` (the training thread waits for its orders inside)."""

    def __init__(self, rank: int, inline: Mapping[str, Handler], send: Callable[[bytes, int], None],
                 watch: HeldWatch, awaiting: Callable[[], ContextManager[None]]) -> None:
        self.rank, self._inline, self._send, self.watch = rank, dict(inline), send, watch
        self._awaiting = awaiting
        self.handlers: dict[str, Handler] = {}
        # the training thread's, each with the stops taken before it came
        self._main: queue.SimpleQueue[tuple[str, int, dict[str, Any], int]] = queue.SimpleQueue()
        # Stop orders taken. An order of the training thread's that a stop came after, before that thread
        # began it, is of a round the controller gave up (a new fault): it is answered, not run — run,
        # it would clear that stop (a rebuild begins so) and wait on peers that the stop let go.
        self._stops = 0
        self._main_actions: set[str] = set()
        self._work: queue.SimpleQueue[tuple[str, int, dict[str, Any]] | None] = queue.SimpleQueue()
        self._done_ids: collections.deque[tuple[int, int]] = collections.deque(maxlen=256)

    def serve(self, handlers: Mapping[str, Handler], training_thread: bool, at_once: bool = False) -> None:
        """Take orders: ``handlers`` maps an action to ``fn(args) -> answer``.
        ``training_thread``: they need the training thread (collectives, the model): they wait in a
        queue until that thread, parked after a fault, runs ``serve_order``. ``at_once``: they return at
        once and run on the processor thread as they come, so that an order the controller sends after
        one of them finds it done (a live fault armed before the park that follows it)."""
        assert not (training_thread and at_once), "an order runs on the training thread or at once, not both"
        for action, fn in handlers.items():
            if at_once:
                self._inline[action] = fn
                continue
            self.handlers[action] = fn
            (self._main_actions.add if training_thread else self._main_actions.discard)(action)

    def first_time(self, epoch: int, aid: int) -> bool:
        """An order not taken before (one is re-sent after a reconnection)."""
        key = (epoch, aid)
        if aid and key in self._done_ids:
            return False
        self._done_ids.append(key)
        return True

    def route(self, action: str, aid: int, args: dict[str, Any]) -> None:
        """(processor thread) Run it now, or queue it for the thread that runs it."""
        if action in self._inline:
            self._stops += action == "stop"
            self.run(action, aid, args)
        elif action in self._main_actions:
            self.watch.queued()
            self._main.put((action, aid, args, self._stops))
        else:
            self._work.put((action, aid, args))

    def run(self, action: str, aid: int, args: dict[str, Any]) -> str | None:
        """Run the order and answer it; returns the last action that ran through (None: it failed)."""
        fn = self.handlers.get(action) or self._inline.get(action)
        if fn is None:
            self.answer(action, aid, False, error=f"no handler for {action!r} on rank {self.rank}")
            return None
        if args.get("then"):
            return self._run_both(action, aid, fn, args)
        handling = sys.exc_info()[1]  # (the training thread serves orders while it handles its step's fault)
        try:
            answer = fn(args)
        except Exception as e:
            log.exception("handler %s failed", action)
            self.answer(action, aid, False, error=f"{type(e).__name__}: {e}", kind=fault_kind(e, handling))
            return None
        if isinstance(answer, Later):
            answer._send = lambda ok, data=None, error="": self.answer(action, aid, ok, data=data, error=error)
            return action
        self.answer(action, aid, True, data=answer)
        return action

    def _run_both(self, action: str, aid: int, fn: Handler, args: dict[str, Any]) -> str | None:
        """``action``, then the order its arguments carry (``then``, on the same thread): one answer."""
        then, then_args = str(args["then"][0]), args["then"][1]
        follow = self.handlers.get(then)
        if follow is None or (then in self._main_actions) != (action in self._main_actions):
            self.answer(action, aid, False, error=f"no handler for {then!r} after {action!r}, on the same thread, "
                                                  f"on rank {self.rank}")
            return None
        answers = []
        handling = sys.exc_info()[1]
        for name, handler, its_args in ((action, fn, {k: v for k, v in args.items() if k != "then"}),
                                        (then, follow, then_args)):
            try:
                answer = handler(its_args)
            except Exception as e:
                log.exception("handler %s failed", name)
                self.answer(action, aid, False, error=f"{name}: {type(e).__name__}: {e}", kind=fault_kind(e, handling))
                return None
            if isinstance(answer, Later):
                self.answer(action, aid, False, error=f"{name} answers later: it cannot be played with another")
                return None
            answers.append(answer)
        self.answer(action, aid, True, data=answers)
        return then

    def answer(self, action: str, aid: int, ok: bool, data: object = None, error: str = "", kind: str = "") -> None:
        """``kind``: a failure's fault kind (a handler that raised a memory or communication error)."""
        fields = {"data": data} if ok and data is not None else {"error": error} if not ok else {}
        if not ok and kind and kind != "other":
            fields["kind"] = kind
        try:
            msg = protocol.encode("result", rank=self.rank, action=action, id=aid, ok=ok, pid=os.getpid(), **fields)
        except protocol.ProtocolError as e:  # a handler's answer that is not a msgpack tree
            msg = protocol.encode("result", rank=self.rank, action=action, id=aid, ok=False,
                                  error=f"rank {self.rank} could not send its answer to {action}: {e}")
        self._send(msg, aid)

    def serve_order(self, timeout: float) -> str | None:
        """The training thread, parked after a fault: run the next order meant for it and send the
        result. Returns the action's name (the one it carried, ``then``, where both ran through; "" for
        one a stop came after: answered, not run), None on timeout."""
        self.watch.on_training_thread()
        try:
            with self._awaiting():
                action, aid, args, stops = self._main.get(timeout=timeout)
        except queue.Empty:
            return None
        if stops < self._stops:
            self.watch.taken(action, more_waiting=not self._main.empty())
            self.watch.ended()
            log.info("rank %d: %s (order %d) not run: the controller's stop came after it", self.rank, action, aid)
            self.answer(action, aid, False, error=f"rank {self.rank}: a stop came after this order; not run")
            return ""
        line = self.watch.taken(action, more_waiting=not self._main.empty())
        if line:
            log.warning("rank %d: %s", self.rank, line)
        try:
            ran = self.run(action, aid, args)
        finally:
            line = self.watch.ended()
            if line:
                log.warning("rank %d: %s", self.rank, line)
        return ran or action

    def work_loop(self) -> None:
        """The handler thread: the orders that need neither the processor's thread nor the training one."""
        while True:
            item = self._work.get()
            if item is None:
                return
            self.run(*item)

    def close(self) -> None:
        self._work.put(None)
