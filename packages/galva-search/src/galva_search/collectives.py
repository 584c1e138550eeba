"""Time of one collective, from a :class:`galva_schema.HardwareProfile` (docs/cost-model.md §2).

Units: message sizes in bytes, times in seconds, bandwidths in GB/s = 1e9 bytes/s, MiB = 2**20 bytes.
All functions take numpy arrays (or scalars) for the message size so that cost tables are built per strategy at once.
"""

from __future__ import annotations

import numpy as np

from galva_comm.layout import group_consecutive
from galva_schema import CollectiveTimes, HardwareProfile, SchemaError

MIB = float(2**20)
GB = 1e9
MAX_OVERLAP_SLOWDOWN = 2.0
"""The overlap slowdown the cost model applies, at most: overlapping then costs what running one after the other
does."""


class Collectives:
    """Collective and point-to-point times on one cluster.

    ``allreduce(n, consecutive, nbytes)``: bus-bandwidth model ``2(n-1)/n * nbytes / busbw``, or the measured
    time-against-size curve of groups of ``n`` consecutive ranks when the profile has one. Reduce-scatter,
    all-gather: their own measured curves when present, else half the bus volume of an all-reduce.
    ``all_to_all``: measured curve, else ``(n-1)/n * nbytes / busbw`` with the all-reduce bus bandwidth of that
    group. ``p2p``: ``nbytes / bw(pp)``. Every collective call also costs the profile's ``call_extra`` of its kind and
    group size: what a call costs inside a busy step beyond the idle curve (docs/cost-model.md §2).
    """

    def __init__(self, profile: HardwareProfile, source: str | None = None) -> None:
        self.profile = profile
        self.source = source
        self.world_size = profile.cluster.world_size
        # at most 2: two activities slowed past that would take longer at once than one after the other, and the
        # processors time-sliced between them cost at worst their sum (docs/cost-model.md §2)
        self.overlap_slowdown = min(float(profile.overlap_slowdown), MAX_OVERLAP_SLOWDOWN)
        self._allreduce_curves = {entry.group_size: entry for entry in profile.allreduce_time}
        self._all_to_all_curves = {entry.group_size: entry for entry in profile.all_to_all_time}
        self._all_gather_curves = {entry.group_size: entry for entry in profile.all_gather_time}
        self._reduce_scatter_curves = {entry.group_size: entry for entry in profile.reduce_scatter_time}
        # a search asks for the same few group bandwidths and curves thousands of times: each looked up once
        self._bandwidths: dict[tuple[int, bool], float] = {}
        self._curve_arrays: dict[int, _CurveArrays] = {}  # id(curve) -> its arrays and line (the profile keeps it)
        self._extras: dict[tuple[int, str], float] = {
            (e.group_size, e.collective): e.ms * 1e-3 for e in profile.call_extra
        }

    # ------------------------------------------------------------------------------------------------ lookups
    def bus_bandwidth_gb_per_s(self, group_size: int, consecutive: bool) -> float:
        """All-reduce bus bandwidth of groups of ``group_size`` (the world-sized group has one layout)."""
        key = (group_size, consecutive)
        hit = self._bandwidths.get(key)
        if hit is not None:
            return hit
        try:
            hit = self._bandwidths[key] = self.profile.allreduce_bandwidth(group_size, consecutive)
            return hit
        except SchemaError:
            layout = "consecutive" if group_consecutive(group_size, self.world_size, consecutive) else "strided"
            raise SchemaError(
                f"allreduce: no entry for group_size {group_size} ({layout}); the search needs it",
                source=self.source,
            ) from None

    def p2p_bandwidth_gb_per_s(self, pp: int) -> float:
        try:
            return self.profile.p2p_bandwidth(pp)
        except SchemaError:
            raise SchemaError(f"p2p: no entry for pp {pp}; the search needs it", source=self.source) from None

    # ------------------------------------------------------------------------------------------------ times
    def allreduce(self, n: int, consecutive: bool, nbytes: np.ndarray | float, busy: bool = True) -> np.ndarray:
        """Seconds for one all-reduce of ``nbytes`` bytes per rank over a group of ``n`` ranks (``busy``: after a
        stretch of compute, :meth:`call_extra` included)."""
        out = self._measured_or_bus(self._allreduce_curves, n, consecutive, nbytes, volume=2.0)
        return self._with_extra(out, n, nbytes, "all_reduce", busy)

    def allreduce_latency(self, n: int, busy: bool = True) -> float:
        """Seconds of an all-reduce of a few bytes over ``n`` ranks: the measured curve's smallest size (one element
        per rank where the profile has that point, else 4 KiB; the line through the swept sizes is least certain
        there), plus the busy extra unless the ranks arrive together (``busy`` False: right after another call over
        them); 0 without a curve."""
        return self._smallest_call(self._allreduce_curves, n, "all_reduce", busy)

    def all_to_all_latency(self, n: int) -> float:
        """Seconds of one all-to-all call of a few bytes over ``n`` ranks after a stretch of compute: the measured
        curve's smallest size plus the busy extra (latency, not bandwidth); 0 without a curve, where only the bytes
        are priced."""
        return self._smallest_call(self._all_to_all_curves, n, "all_to_all", True)

    def _smallest_call(self, curves: dict[int, CollectiveTimes], n: int, collective: str, busy: bool) -> float:
        """A call at the smallest measured size of the curve of groups of ``n`` (whichever ranks the group holds: a
        latency), with :meth:`call_extra` when ``busy``; 0 without a curve or for a group of one."""
        curve = curves.get(n) if n > 1 else None
        if curve is None:
            return 0.0
        return curve.time_ms[0] * 1e-3 + (self.call_extra(n, collective) if busy else 0.0)

    def call_extra(self, n: int, collective: str) -> float:
        """Seconds one ``collective`` call over ``n`` ranks costs inside a busy step beyond its idle curve: the
        profile's ``call_extra`` (0 for a group of 1 and for profiles without it)."""
        return self._extras.get((n, collective), 0.0) if n > 1 else 0.0

    def _with_extra(
        self, seconds: np.ndarray, n: int, nbytes: np.ndarray | float, collective: str, busy: bool = True
    ) -> np.ndarray:
        """``seconds`` plus :meth:`call_extra` wherever a call is made (a message of bytes over a group) after a
        stretch of compute (``busy``); a call right after another over the same group (its ranks arrive together)
        costs its idle curve."""
        extra = self.call_extra(n, collective) if busy else 0.0
        if extra == 0.0:
            return seconds
        return np.where(np.asarray(nbytes, dtype=float) > 0, seconds + extra, seconds)

    def reduce_scatter(self, n: int, consecutive: bool, nbytes: np.ndarray | float, busy: bool = True) -> np.ndarray:
        """Seconds for a reduce-scatter whose *input* is ``nbytes`` per rank: its measured curve (latency included)
        when the profile has one for consecutive groups of ``n``, else half an all-reduce's bus volume; ``busy`` as
        :meth:`allreduce`."""
        out = self._half_or_curve(self._reduce_scatter_curves, n, consecutive, nbytes)
        return self._with_extra(out, n, nbytes, "reduce_scatter", busy)

    def all_gather(self, n: int, consecutive: bool, nbytes: np.ndarray | float, busy: bool = True) -> np.ndarray:
        """Seconds for an all-gather whose *output* is ``nbytes`` per rank: its measured curve when the profile has
        one for consecutive groups of ``n``, else half an all-reduce's bus volume; ``busy`` as :meth:`allreduce`."""
        out = self._half_or_curve(self._all_gather_curves, n, consecutive, nbytes)
        return self._with_extra(out, n, nbytes, "all_gather", busy)

    def _half_or_curve(
        self, curves: dict[int, CollectiveTimes], n: int, consecutive: bool, nbytes: np.ndarray | float
    ) -> np.ndarray:
        nbytes = np.asarray(nbytes, dtype=float)
        curve = self._measured(curves, n, consecutive) if n > 1 else None
        if curve is not None:
            return self._curve_seconds(curve, nbytes)
        return 0.5 * self._measured_or_bus(self._allreduce_curves, n, consecutive, nbytes, volume=2.0)

    def all_to_all(self, n: int, consecutive: bool, nbytes: np.ndarray | float, busy: bool = True) -> np.ndarray:
        """Seconds for one all-to-all of an ``nbytes`` buffer per rank over ``n`` ranks; below the curve's smallest
        measured size, that size's time, not the line through the measured sizes: an all-to-all that small is
        latency-bound (expert dispatch's row counts and routing weights are bytes to kilobytes; on 4 loaded gloo
        ranks one of 16 bytes took 1.28 ms, of 256 KiB 1.16 ms, while a --quick curve's line gave 2.06 ms at 0 against
        2.63 ms measured at its smallest size, 0.25 MiB); ``busy`` as :meth:`allreduce`."""
        nbytes = np.asarray(nbytes, dtype=float)
        out = self._measured_or_bus(self._all_to_all_curves, n, consecutive, nbytes, volume=1.0)
        curve = self._measured(self._all_to_all_curves, n, consecutive) if n > 1 else None
        if curve is not None:
            smallest = curve.message_mib[0] * MIB
            out = np.where((nbytes > 0) & (nbytes < smallest), curve.time_ms[0] * 1e-3, out)
        return self._with_extra(out, n, nbytes, "all_to_all", busy)

    def _measured_or_bus(
        self, curves: dict[int, CollectiveTimes], n: int, consecutive: bool, nbytes: np.ndarray | float, volume: float
    ) -> np.ndarray:
        """The measured curve of groups of ``n`` where the profile has one, else ``volume * (n-1)/n * nbytes`` over
        the all-reduce bus bandwidth of that group (``volume`` 2 for an all-reduce, 1 for an all-to-all)."""
        nbytes = np.asarray(nbytes, dtype=float)
        if n <= 1:
            return np.zeros_like(nbytes)
        curve = self._measured(curves, n, consecutive)
        if curve is not None:
            return self._curve_seconds(curve, nbytes)
        return volume * (n - 1) / n * nbytes / (self.bus_bandwidth_gb_per_s(n, consecutive) * GB)

    def _measured(self, curves: dict[int, CollectiveTimes], n: int, consecutive: bool) -> CollectiveTimes | None:
        """The measured curve of groups of ``n``: curves are measured on consecutive groups, which a strided group of
        the whole world is too (:func:`galva_comm.layout.group_consecutive`)."""
        return curves.get(n) if group_consecutive(n, self.world_size, consecutive) else None

    def _curve_seconds(self, curve: CollectiveTimes, nbytes: np.ndarray) -> np.ndarray:
        arrays = self._curve_arrays.get(id(curve))
        if arrays is None:
            arrays = self._curve_arrays[id(curve)] = _curve_arrays(curve)
        return _curve_seconds(arrays, nbytes)

    def p2p_latency(self, pp: int) -> float:
        """Seconds of one send's latency between neighbouring stages: the profile's ``latency_ms`` (0 if absent) and
        what a send to a waiting receiver costs beyond it in a busy step (its ``call_extra`` of ``"p2p"``)."""
        if pp <= 1:
            return 0.0
        return self.profile.p2p_latency_ms(pp) * 1e-3 + self.call_extra(pp, "p2p")

    def p2p(self, pp: int, nbytes: np.ndarray | float) -> np.ndarray:
        """Seconds to send ``nbytes`` from one pipeline stage to the next (bandwidth only; see p2p_latency)."""
        nbytes = np.asarray(nbytes, dtype=float)
        if pp <= 1:
            return np.zeros_like(nbytes)
        return nbytes / (self.p2p_bandwidth_gb_per_s(pp) * GB)

    def overlapped(self, compute: np.ndarray | float, comm: np.ndarray | float) -> np.ndarray:
        """Wall time of ``compute`` and ``comm`` seconds run concurrently.

        While both run, each is slowed by ``overlap_slowdown`` (sigma, at most :data:`MAX_OVERLAP_SLOWDOWN`); the
        longer one then finishes alone: ``min(x, y) * sigma + |x - y|`` (the reference's ``overlap`` + ``rest``,
        §4.1 step 5), never more than ``x + y``.
        """
        x = np.asarray(compute, dtype=float)
        y = np.asarray(comm, dtype=float)
        return np.minimum(x, y) * self.overlap_slowdown + np.abs(x - y)


_CurveArrays = tuple[np.ndarray, np.ndarray, float, float]  # sizes MiB, times ms, the line's slope and intercept


def _curve_arrays(curve: CollectiveTimes) -> _CurveArrays:
    return np.asarray(curve.message_mib, dtype=float), np.asarray(curve.time_ms, dtype=float), *curve.linear_fit()


def _curve_seconds(curve: _CurveArrays, nbytes: np.ndarray) -> np.ndarray:
    """Measured time at ``nbytes``: linear interpolation inside the measured sizes, the least-squares line outside."""
    sizes, times, slope, intercept = curve
    mib = nbytes / MIB
    inside = np.interp(mib, sizes, times)
    outside = np.maximum(slope * mib + intercept, 0.0)
    ms = np.where((mib >= sizes[0]) & (mib <= sizes[-1]), inside, outside)
    return np.where(nbytes > 0, ms * 1e-3, 0.0)
