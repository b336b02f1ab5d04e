"""An experiment, not the simulator's model: charge each running row of the modeled
instances half a KV block (the engine allocates whole blocks, so a row's last block is
on average half empty), then run ``seer_engine`` with the arguments given.

    python benchmarks/results/history/g48/partial_blocks/run.py simulate ... --report OUT
"""

import sys

from seer_engine.entrypoints import cli
from seer_engine.sim import instance

_running_kv = instance.SimInstance._running_kv


def running_kv_with_partial_blocks(self) -> float:
    rows = len(self.decoding) + len(self.prefilling)
    return _running_kv(self) + rows * (self.profile.block_size - 1) / 2


instance.SimInstance._running_kv = running_kv_with_partial_blocks
sys.exit(cli.main(sys.argv[1:]))
