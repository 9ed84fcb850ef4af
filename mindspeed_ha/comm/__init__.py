"""Communication helpers: interruptible collectives (the rank side of *stop*)."""
from mindspeed_ha.comm.interruptible import (  # noqa: F401
    CollectiveStopped,
    PollingWork,
    add_abort_hook,
    clear_stop,
    remove_abort_hook,
    request_stop,
    stop_requested,
    wait_work,
)
