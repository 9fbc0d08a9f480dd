"""``tpplan search`` (docs/search.md): every layout of a plan at a world size, checked and
ranked by estimated step time.

- ``ranking``: the search itself: bounds first, then traces, best first.
- ``candidates``: the layouts tried: every mesh of the world size and every option.
- ``bounds``: lower bounds of a candidate's peak memory that drop it untraced.
- ``check_cache``: a candidate's checks cached by part across the variants of one plan.
- ``trace_cache``: dry runs of many variants of one plan sharing what their traces share.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "candidates": ["Candidate", "Options", "candidates"],
    "ranking": ["search"],
})
