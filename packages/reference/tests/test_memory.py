"""device_memory_bytes: the machine's RAM on CPU (what calibration checks its statistics against)."""

import os

from swiftkv_reference.memory import device_memory_bytes


def test_cpu_memory_is_the_physical_ram():
    assert device_memory_bytes("cpu") == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") > 1 << 20
