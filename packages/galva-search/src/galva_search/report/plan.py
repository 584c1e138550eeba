"""What the page shows of a plan: a strategy and the search summary galva-search wrote with it."""

from __future__ import annotations

from dataclasses import dataclass

from galva_schema import RunCheck, SearchSummary, Strategy


class ReportError(ValueError):
    """Nothing to report, or a malformed input; the message is one line."""


@dataclass(frozen=True)
class PlanFacts:
    """A strategy and its :class:`galva_schema.SearchSummary` (predicted cost, what the search did), and the
    :class:`galva_schema.RunCheck` of a run of it where there is one (measured against predicted, noise bands)."""

    strategy: Strategy
    summary: SearchSummary
    check: RunCheck | None = None

    @classmethod
    def matched(
        cls,
        strategy: Strategy,
        summary: SearchSummary,
        summary_source: str = "summary",
        strategy_source: str = "strategy",
    ) -> PlanFacts:
        """The pair, refused with one line when the summary was written for another plan (another model's layer
        count, another division, schedule or batch: :meth:`galva_schema.SearchSummary.mismatch`)."""
        mismatch = summary.mismatch(strategy)
        if mismatch is not None:
            raise ReportError(
                f"{summary_source}: {mismatch} in {strategy_source}: the summary of another plan; give the "
                f"--summary-json galva-search wrote with this strategy"
            )
        return cls(strategy, summary)
