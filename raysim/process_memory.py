"""The peak resident memory of this process (summary.json's driver and server peaks, the index
shards' reports). Ground floor: the standard library only."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
