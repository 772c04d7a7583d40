"""What a CRIU dump of a process will write: its anonymous memory, from /proc/PID/smaps.

CRIU's page files hold the pages of private and anonymous mappings that are present (file pages
only where the process wrote them: smaps counts those as Anonymous too), so the sum of the
Anonymous fields is the image's size to within its metadata, and the mappings that hold it say
what a smaller image would have to leave out. A restore costs about the image's size over the
rate at which the kernel faults in fresh pages (`python -m bench.criu_restore`).
"""

from __future__ import annotations

import collections


def anonymous_by_mapping(pid: int, top: int = 8) -> dict:
    """{"total_bytes": all anonymous bytes, "by_name": [[name, bytes], ...], "largest": [[name,
    bytes], ...]}: the `top` names holding the most, and the `top` single mappings. A mapping is
    named by its file, [heap], [stack], or [anon] where it has no name (malloc arenas, Python's
    allocations, what the CUDA driver keeps in host memory for a checkpointed GPU: the single
    mappings tell those apart)."""
    by_name: collections.Counter[str] = collections.Counter()
    single: list[tuple[int, str]] = []
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's first line: range perms offset dev inode [name]
                fields = rest.split(maxsplit=4)
                name = fields[4].strip() if len(fields) == 5 else "[anon]"
            elif head == "Anonymous:":
                n = int(rest.split()[0]) * 1024
                by_name[name] += n
                single.append((n, name))
    single.sort(reverse=True)
    return {
        "total_bytes": sum(by_name.values()),
        "by_name": [[n, b] for n, b in by_name.most_common(top) if b],
        "largest": [[n, b] for b, n in single[:top] if b],
    }
