"""Stop strings, matched incrementally on the decoded stream at the API edge.

Each push costs O(stops x (new text + longest stop)): only the text not yet released is
scanned, never the whole output again. Text that could still be the start of a stop string is
held back, so a stream never shows part of a stop.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self._buf = ""  # decoded text not yet released
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        """Add decoded text; return the text now safe to release (empty after a stop)."""
        if self.stopped is not None:
            return ""
        buf = self._buf + text
        if not self.stops:
            self._buf = ""
            return buf
        cut, which = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut, which = i, s
        if cut >= 0:
            self._buf, self.stopped = "", which
            return buf[:cut]
        keep = self._partial(buf)
        self._buf = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def would_stop(self, tail: str) -> bool:
        """Whether ``tail`` (text not pushed: e.g. an unfinished character shown as U+FFFD) would
        complete a stop after what was pushed."""
        return self.stopped is not None or any(s in self._buf + tail for s in self.stops)

    def flush(self) -> str:
        """The end of the text: whatever was held back could not start a stop after all."""
        out, self._buf = ("" if self.stopped is not None else self._buf), ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop."""
        best = 0
        for s in self.stops:
            lo = max(len(buf) - (len(s) - 1), 0)
            i = buf.find(s[0], lo)
            while i >= 0:
                if len(buf) - i > best and s.startswith(buf[i:]):
                    best = len(buf) - i
                    break
                i = buf.find(s[0], i + 1)
        return best
