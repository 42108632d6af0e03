"""What the kernel says of this process's memory mappings (/proc/self/smaps), for tests of memory advice."""

from __future__ import annotations


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` ("hg": advised to use huge pages)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
