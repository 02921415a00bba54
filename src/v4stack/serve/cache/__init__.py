"""V4's hybrid cache: a fixed-size state cache per request and a paged block cache."""

from v4stack.serve.cache.manager import CacheManager, CacheFull
from v4stack.serve.cache.spec import CacheSpec, GroupSpec

__all__ = ["CacheManager", "CacheFull", "CacheSpec", "GroupSpec"]
