"""``torchrun --nproc_per_node=N -m fl_platform.ssgd [overrides]``: one S-SGD run (see docs/ssgd.md).

Without torchrun it is a world of one. ``fl-ssgd --nproc-per-node N [overrides]`` starts torchrun
for you (fl_platform/ssgd/launch.py).
"""

from fl_platform.ssgd.distributed import end_worker
from fl_platform.ssgd.launch import run_worker

if __name__ == "__main__":
    end_worker(run_worker())
