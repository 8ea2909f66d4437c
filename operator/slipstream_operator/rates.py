"""Token rates and ETAs for status: counters over a time window, never an instant's sum.

A shard's sidecar reports how many output tokens it has produced on its pod
(``ShardReport.output_tokens``). A :class:`TokenMeter` turns those per-shard
counters into one monotonic total and keeps ``(time, total)`` samples over a
window, so the rate it reads is what was produced in the window divided by the
window's length. A shard that finishes, moves or has only just started does not
pull the rate to zero, as summing the rates of the shards placed at one instant
would.

Counting rules, per key (``(pod, shard)``):

* a key seen for the first time adds its whole counter (a shard placed since the
  last tick starts from zero), except on the meter's first sample, which only
  records where the counters stand (after an operator restart the shards' past
  tokens are not this window's);
* a counter that went down was restarted (the shard was assigned again on that
  pod): its new value is all new;
* a key missing from a tick (a pod that did not answer) keeps its last value, so
  when it answers again only the tokens since then count; the caller names the keys
  that will not come back (``forget``).

Pure: no clock, no I/O; the caller passes ``now_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class TokenMeter:
    """Output tokens counted so far and the samples of the last window."""

    seen: Mapping[Key, int] = field(default_factory=dict, hash=False)
    total: int = 0
    history: tuple[tuple[float, int], ...] = ()  # (now_s, total), oldest first

    def advance(self, counters: Mapping[Key, int], now_s: float, window_s: float,
                *, forget: frozenset[Key] = frozenset()) -> TokenMeter:
        """The meter after a tick that read ``counters``.

        ``forget`` names keys that will not be reported again (a finished shard, a pod
        that is gone): those not in ``counters`` are dropped, so the meter does not grow
        with a job's history.
        """
        first = not self.history
        seen = dict(self.seen)
        total = self.total
        for key, value in counters.items():
            before = seen.get(key)
            if before is None:
                total += 0 if first else value
            elif value >= before:
                total += value - before
            else:
                total += value
            seen[key] = value
        if forget:
            for key in [k for k in forget if k in seen and k not in counters]:
                del seen[key]
        kept = self._kept(now_s, window_s)
        return TokenMeter(seen, total, (*kept, (now_s, total)))

    def _kept(self, now_s: float, window_s: float) -> tuple[tuple[float, int], ...]:
        """The samples within ``window_s`` of ``now_s``, and the newest one before that.

        The sample just outside the window is kept as the window's start, so the rate
        always spans at least one full window once the meter is that old.
        """
        inside = [s for s in self.history if now_s - s[0] <= window_s]
        older = [s for s in self.history if now_s - s[0] > window_s]
        return (*older[-1:], *inside)

    def rate(self) -> float | None:
        """Tokens per second over the window; None until two samples span some time."""
        if len(self.history) < 2:
            return None
        (t0, n0), (t1, n1) = self.history[0], self.history[-1]
        if t1 <= t0:
            return None
        return max(0.0, (n1 - n0) / (t1 - t0))


def format_eta(seconds: float) -> str:
    """An ETA for people: ``1h2m``, ``3m5s`` or ``8s`` (a parseable duration, whole units).

    A positive time under a second reads ``1s``; zero or less reads ``0s``.
    """
    if seconds <= 0:
        return "0s"
    total = max(1, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
