"""Communication helpers: the rank's stop (``comm.stop``) and the collectives that obey it
(``comm.interruptible``, whose ``PROCESS_STOP`` is the process's one stop)."""
from mindspeed_ha.comm.interruptible import PROCESS_STOP, PollingWork, wait_work  # noqa: F401
from mindspeed_ha.comm.stop import CollectiveStopped, Stop  # noqa: F401
