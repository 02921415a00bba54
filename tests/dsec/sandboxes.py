"""What the attack and hostile-input suites share: the small limits and the substrates (the ``sbx`` fixture in conftest makes one sandbox per substrate)."""

from __future__ import annotations

from v4stack.dsec import substrates
from v4stack.dsec.cgroups import Limits

SUBSTRATES = list(substrates.NAMES)
SMALL = Limits(memory_bytes=64 << 20, pids=64, disk_bytes=16 << 20)
