"""Budgets and devices: how many bytes the memory plan may use, from a size ("5.5GB", "80%" of MemAvailable) or a
device profile (configs/devices/NAME.yaml: its memory less what the OS keeps). Units as in runtime/memory/plan.py:
GB = 1e9 and GiB = 2**30 when parsing, a profile's memory_gb is GiB, reserved_mb is MiB."""
from __future__ import annotations

import os
import re
from typing import List

from runtime.config import DeviceProfile, load_config
from runtime.errors import ConfigError
from runtime.memory.plan import GiB, MiB

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": MiB, "gib": GiB}


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable in bytes: on Jetson the GPU allocates from the same memory, and MemAvailable (not
    MemFree, not cudaMemGetInfo) counts the page cache the kernel can reclaim."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError(f"{meminfo}: no MemAvailable line; give the budget in bytes (--budget 5.5GB)")


def parse_budget(text: str, source: str = "--budget", meminfo: str = "/proc/meminfo") -> int:
    """Bytes from "5.5GB" (1e9), "5GiB" (2**30), "5632MiB", "6000000000", or "80%" of MemAvailable
    on the machine this runs on. parse_budget("1.5GiB") == 1610612736."""
    s = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(%|[kmg]i?b|b)?", s)
    if m is None or float(m.group(1)) <= 0 or (m.group(2) == "%" and float(m.group(1)) > 100):
        raise ConfigError(f"{source}: got {text!r}, expected a size such as 5.5GB, 5GiB, 5632MiB or 6000000000 "
                          "(bytes), or a share of MemAvailable such as 80%")
    if m.group(2) == "%":
        return int(float(m.group(1)) / 100 * mem_available(meminfo))
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def device_names(devices_dir: str) -> List[str]:
    return sorted(f[:-5] for f in os.listdir(devices_dir) if f.endswith(".yaml")) if os.path.isdir(devices_dir) else []


def load_device(name: str, devices_dir: str) -> DeviceProfile:
    """A device profile by name (configs/devices/NAME.yaml) or by the path of a YAML file."""
    path = name if name.endswith((".yaml", ".yml")) else os.path.join(devices_dir, name + ".yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"--device: unknown device {name!r}; choose one of {device_names(devices_dir)} "
                          f"(the profiles in {devices_dir}) or give the path of a device YAML")
    return load_config(path, DeviceProfile)


def device_budget(device: DeviceProfile) -> int:
    """What a device leaves to edgespec by default: its memory less what the OS/desktop keeps."""
    return int(device.memory_gb * GiB - device.reserved_mb * MiB)


