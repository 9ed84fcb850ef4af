"""Every transition of the recovery state machine table, and the strategy choice."""
import pytest

from mindspeed_ha.control.states import (HANDLES, TABLE, TIMEOUTS, Machine, Outcome as O, State as S,
                                         TransitionError, choose_strategy, next_state)
from mindspeed_ha.options import PREFERENCE


@pytest.mark.parametrize("state,outcome", sorted(TABLE, key=str))
def test_every_transition(state, outcome):
    seen = []
    m = Machine(lambda *a: seen.append(a), state=state)
    new = m.feed(outcome)
    assert new == TABLE[(state, outcome)] == next_state(state, outcome)
    (old, out, to, seconds), = seen
    assert (old, out, to) == (state, outcome, new) and seconds >= 0
    assert m.history[-1][:3] == (state, outcome, new)


def test_undefined_transitions_raise():
    defined = set(TABLE)
    for s in S:
        for o in O:
            if (s, o) not in defined:
                with pytest.raises(TransitionError):
                    next_state(s, o)


def test_every_state_reachable_and_done_terminal():
    reach, todo = {S.INIT}, [S.INIT]
    while todo:
        s = todo.pop()
        for (a, _), b in TABLE.items():
            if a == s and b not in reach:
                reach.add(b)
                todo.append(b)
    assert reach == set(S)
    assert not [k for k in TABLE if k[0] == S.DONE]
    # a fault can be taken from every non-terminal state except the init wait's own timeout path
    assert all((s, O.FAULT) in TABLE for s in S if s not in (S.DONE,))


def test_every_busy_state_has_timeout_and_failure_exit():
    for s in (S.PAUSE, S.ENV_CLEAR, S.REPAIR, S.ROLLBACK, S.DUMP, S.DOWNGRADE, S.UPGRADE, S.EXIT):
        assert s in TIMEOUTS and (s, O.TIMEOUT) in TABLE


def test_fault_life_reads_as_one_sequence():
    m = Machine()
    for o in (O.REGISTERED, O.FAULT, O.STOPPED, O.RETRY, O.OK, O.OK):
        m.feed(o)
    assert [h[2] for h in m.history] == [S.NORMAL, S.PAUSE, S.ENV_CLEAR, S.REPAIR, S.ROLLBACK, S.NORMAL]


def test_strategy_order_and_fault_class():
    all_on = list(PREFERENCE)
    built = {"retry", "recover", "dump"}
    assert choose_strategy(all_on, {"memory-error"}, built)[0] == O.RETRY
    assert choose_strategy(all_on, {"comm-failure"}, built)[0] == O.RETRY
    assert choose_strategy(all_on, {"process-exit"}, built)[0] == O.RECOVER
    assert choose_strategy(all_on, {"process-exit", "comm-failure"}, built)[0] == O.RECOVER
    assert choose_strategy(["dump"], {"memory-error"}, built)[0] == O.DUMP
    assert choose_strategy(["retry"], {"hang"}, built)[0] == O.NO_STRATEGY
    assert choose_strategy(["elastic-training"], {"node-lost"}, {"elastic-training"})[0] == O.ELASTIC


def test_this_build_ends_the_job():
    out, why = choose_strategy(["dump"], {"process-exit"}, set())
    assert out == O.NO_STRATEGY and "not available" in why
    assert next_state(S.ENV_CLEAR, out) == S.EXIT
    assert choose_strategy([], {"other"}, set())[0] == O.NO_STRATEGY
    assert all(k in HANDLES["dump"] for k in ("process-exit", "hang", "memory-error", "other"))


def test_overdue():
    m = Machine(state=S.PAUSE)
    assert not m.overdue()
    m.entered -= TIMEOUTS[S.PAUSE] + 0.1
    assert m.overdue()
