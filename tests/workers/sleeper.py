"""A worker that only sleeps: for agent tests that need processes, not training."""
import os
import sys
import time

print(f"sleeper rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"restart {os.environ.get('MINDSPEED_HA_RESTART_COUNT')}", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 60)
