"""llmd: a local LLM serving daemon."""
import os

__version__ = "0.1.0"

# CPU threads that wait between parallel regions sleep instead of spinning (read by OpenMP when torch loads, so this
# must run first). With the default spin, a decode step on a desktop whose cores are busy with other programs waits
# on descheduled spinning threads: SmolLM2 on 2 busy cores ran 0.6 tok/s spinning vs 22.7 tok/s sleeping (1 thread:
# 27.1). An explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
