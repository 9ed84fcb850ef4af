"""Flags, HIGH_AVAILABILITY and MS_ENABLE_TFT map to one options object; bad input gets a clear error."""
import pytest

from mindspeed_ha.options import HAConfigError, from_args
from mindspeed_ha.trainer.args import build_parser


def opts(argv, env=None):
    return from_args(build_parser().parse_args(argv), env or {})


def test_off_by_default():
    o = opts([])
    assert not o.enabled and not o.use_replica_optimizer


def test_enable_high_availability_is_dump_with_replicas():
    o = opts(["--enable-high-availability"])
    assert o.strategies == {"dump"} and o.use_replica_optimizer and o.replica_num == 2


@pytest.mark.parametrize("env", [{"HIGH_AVAILABILITY": "dump"}, {"HIGH_AVAILABILITY": " Dump , "},
                                 {"MS_ENABLE_TFT": "{TTP:1}"}, {"MS_ENABLE_TFT": "{TTP:1,UCE:0,ARF:0}"}])
def test_env_and_alias_turn_dump_on(env):
    o = opts([], env)
    assert o.strategies == {"dump"}


def test_env_wins_over_flags():
    o = opts(["--enable-high-availability"], {"HIGH_AVAILABILITY": "dump", "MS_ENABLE_TFT": "{TTP:0}"})
    assert o.source == "HIGH_AVAILABILITY" and o.strategies == {"dump"}


@pytest.mark.parametrize("argv,env", [(["--enable-hbmfault-repair"], {}), ([], {"HIGH_AVAILABILITY": "retry"}),
                                       ([], {"MS_ENABLE_TFT": "{UCE:1}"})])
def test_retry_with_dump_under_it(argv, env):
    o = opts(argv, env)
    assert o.ordered_strategies() == ["retry", "dump"] and o.use_replica_optimizer


def test_high_availability_wins_over_alias():
    o = opts([], {"HIGH_AVAILABILITY": "dump", "MS_ENABLE_TFT": "{TTP:0}"})
    assert o.enabled


@pytest.mark.parametrize("env,needle", [
    ({"HIGH_AVAILABILITY": "dump,turbo"}, "unknown value(s) 'turbo'"),
    ({"MS_ENABLE_TFT": "{XYZ:1}"}, "MS_ENABLE_TFT"),
    ({"MS_ENABLE_TFT": "TTP=1"}, "expected e.g."),
])
def test_bad_env_values(env, needle):
    with pytest.raises(HAConfigError) as e:
        opts([], env)
    assert needle in str(e.value)


@pytest.mark.parametrize("argv,env,order", [
    (["--enable-elastic-training"], {}, ["elastic-training", "dump"]),
    ([], {"HIGH_AVAILABILITY": "elastic-training,recover"}, ["recover", "elastic-training", "dump"]),
])
def test_elastic_comes_after_recover_and_before_the_dump(argv, env, order):
    assert opts(argv, env).ordered_strategies() == order


def test_elastic_needs_the_replica_optimizer():
    with pytest.raises(HAConfigError) as e:
        opts(["--enable-elastic-training", "--distributed-optimizer-no-replica"], {})
    assert "--enable-elastic-training" in str(e.value) and "--distributed-optimizer-no-replica" in str(e.value)


@pytest.mark.parametrize("argv,needle", [
    (["--distributed-optimizer-no-replica"], "--distributed-optimizer-no-replica"),
    (["--enable-high-availability", "--optimizer-replica-num", "1"], "--optimizer-replica-num 1"),
    (["--ha-verify-replicas-interval", "5"], "--ha-verify-replicas-interval"),
    (["--enable-high-availability", "--distributed-optimizer-no-replica", "--ha-verify-replicas-interval", "2"],
     "needs the replica"),
    (["--enable-elastic-training", "--ha-spare-wait", "-1"], "--ha-spare-wait -1"),
    (["--enable-elastic-training", "--ha-spare-wait", "inf"], "0 or more"),
    (["--enable-hbmfault-repair", "--ha-recovery-message-mib", "0"], "--ha-recovery-message-mib 0"),
])
def test_inconsistent_flags(argv, needle):
    with pytest.raises(HAConfigError) as e:
        opts(argv)
    assert needle in str(e.value)


def test_recovery_message_size():
    assert opts(["--enable-hbmfault-repair"]).recovery_message_mib == 64
    assert opts(["--enable-hbmfault-repair", "--ha-recovery-message-mib", "8"]).recovery_message_mib == 8


def test_no_replica_keeps_ha_but_not_replicas():
    o = opts(["--enable-high-availability", "--distributed-optimizer-no-replica"])
    assert o.enabled and not o.use_replica_optimizer


def test_ordered_strategies_preference():
    from mindspeed_ha.options import HAOptions
    o = HAOptions(strategies=frozenset({"dump", "recover", "retry"}))
    assert o.ordered_strategies() == ["retry", "recover", "dump"]


@pytest.mark.parametrize("argv,env", [
    (["--enable-worker-reboot"], {}),
    ([], {"HIGH_AVAILABILITY": "recover"}),
    ([], {"MS_ENABLE_TFT": "{TTP:1,ARF:1}"}),
])
def test_recover_is_accepted_with_the_dump_as_last_resort(argv, env):
    assert opts(argv, env).ordered_strategies() == ["recover", "dump"]


@pytest.mark.parametrize("env,needle", [
    ({"HIGH_AVAILABILITY": ","}, "HIGH_AVAILABILITY=',' names no strategy"),
    ({"HIGH_AVAILABILITY": ""}, "HIGH_AVAILABILITY='' names no strategy"),
    ({"MS_ENABLE_TFT": "{}"}, "MS_ENABLE_TFT='{}' names no feature"),
    ({"MS_ENABLE_TFT": " "}, "names no feature"),
])
def test_set_but_empty_switches_are_refused_not_read_as_off(env, needle):
    """An empty HIGH_AVAILABILITY or MS_ENABLE_TFT is a mistake, not a quiet 'HA off'."""
    with pytest.raises(HAConfigError) as e:
        opts(["--enable-high-availability"], env)
    assert needle in str(e.value) and "unset it" in str(e.value)


@pytest.mark.parametrize("argv,needle", [
    (["--ha-heartbeat-interval", "nan"], "--ha-heartbeat-interval nan"),
    (["--ha-heartbeat-interval", "inf"], "--ha-heartbeat-interval inf"),
    (["--ha-heartbeat-interval", "-1"], "--ha-heartbeat-interval -1.0"),
    (["--ha-hang-timeout", "0"], "--ha-hang-timeout 0.0"),
    (["--ha-dump-timeout", "nan"], "--ha-dump-timeout nan"),
])
def test_non_finite_or_negative_times_are_refused(argv, needle):
    with pytest.raises(HAConfigError) as e:
        opts(["--enable-high-availability", *argv])
    assert needle in str(e.value) and "finite number of seconds above 0" in str(e.value)


def test_spares_count():
    assert opts(["--enable-worker-reboot"]).spares == 1
    assert opts(["--enable-worker-reboot", "--ha-spares", "3"]).spares == 3
    with pytest.raises(HAConfigError) as e:
        opts(["--enable-worker-reboot", "--ha-spares", "-1"])
    assert "--ha-spares -1" in str(e.value) and "use 0" in str(e.value)


def test_unwritable_directories_are_refused(tmp_path):
    from mindspeed_ha.options import check_writable
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(HAConfigError) as e:
        check_writable(str(blocker / "ck"), "--save")
    assert f"--save {blocker}/ck: cannot write there" in str(e.value)
    check_writable(str(tmp_path / "new" / "ck"), "--save")  # made when missing
    assert (tmp_path / "new" / "ck").is_dir()


def test_the_hang_limit_must_come_before_the_collectives_timeout():
    """NCCL's watchdog aborts a collective that outlives --distributed-timeout-minutes: the controller
    must have named the hang first (up to twice its limit, at least 30 s in a process's first steps)."""
    def timed(*argv):
        return opts(["--enable-high-availability", "--distributed-timeout-minutes", *argv])
    assert timed("10").collective_timeout_s == 600.0 and timed("10").hang_timeout_s == 60.0
    with pytest.raises(HAConfigError) as e:
        timed("1")  # the default hang limit, 60 s: a hang named after up to 120 s
    assert ("--ha-hang-timeout 60 s" in str(e.value) and "--distributed-timeout-minutes 1" in str(e.value)
            and "to at least 3" in str(e.value) and "lower" not in str(e.value)), e.value  # (30 s at least)
    with pytest.raises(HAConfigError) as e:
        timed("3", "--ha-hang-timeout", "100")
    assert "to at least 4 or lower --ha-hang-timeout below 90" in str(e.value), e.value
    assert timed("2", "--ha-hang-timeout", "20").hang_timeout_s == 20.0  # 2 x max(20, 30) = 60 < 120


def test_a_script_flag_that_starts_like_an_ha_flag_is_the_scripts():
    """What a launcher agent reads of a training script's command line: Megatron's ``--optimizer adam``
    (a prefix of ``--optimizer-replica-num``) is the script's own flag, not an abbreviation of ours."""
    from mindspeed_ha.options import from_script_args
    o = from_script_args(["--optimizer", "adam", "--enable-high-availability", "--use-distributed-optimizer"], {})
    assert o is not None and o.enabled and o.replica_num == 2
    o = from_script_args(["--optimizer", "sgd", "--enable-hbmfault-repair"], {})
    assert o is not None and o.strategies == {"retry", "dump"}
    assert from_script_args(["--optimizer-replica-num", "3", "--enable-high-availability"], {}).replica_num == 3


def test_the_wait_for_orders_has_a_flag_of_its_own_and_follows_the_hang_timeout_without_it():
    """--ha-hang-timeout names a silent rank hung; how long a rank out of training waits for the
    controller's orders is --ha-order-timeout, derived from the hang timeout when not given."""
    plain = opts(["--enable-high-availability"])
    assert plain.orders_wait_s() == 180.0 and plain.orders_wait_s(joining=True) == 180.0
    short = opts(["--enable-high-availability", "--ha-hang-timeout", "3"])
    assert short.orders_wait_s() == 30.0 and short.orders_wait_s(joining=True) == 120.0
    own = opts(["--enable-high-availability", "--ha-hang-timeout", "3", "--ha-order-timeout", "45"])
    assert own.orders_wait_s() == 45.0 and own.orders_wait_s(joining=True) == 45.0 and own.hang_timeout_s == 3.0
    with pytest.raises(HAConfigError, match="--ha-order-timeout 0.0: give a finite number of seconds above 0"):
        opts(["--enable-high-availability", "--ha-order-timeout", "0"])
