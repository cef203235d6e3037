"""Bad image files gathered over a whole dataset before anything is refused, so that a run
names every one in one refusal instead of one per run (each run costs a minute or more)."""

from __future__ import annotations

import collections

SHOWN_BAD = 3  # bad files named in the warning that counts the skipped ones


SKIP = "set skip-bad-images=true to leave such files out"


class BadImages(ValueError):
    """Every bad file of a dataset, (path, what is wrong, what to do) each, in one line. Several
    are counted per remedy first, the fewest first, so that the line's start says what to do
    (one setting may fix hundreds), and then all named, those of the rarer remedies first."""

    def __init__(self, bad: list[tuple[str, str, str]]):
        self.bad = bad
        if len(bad) == 1:
            name, why, fix = bad[0]
            super().__init__(f"{name}: {why}; {fix}, or {SKIP}")
            return
        counts = collections.Counter(fix for _, _, fix in bad)
        order = sorted(counts, key=lambda fix: counts[fix])  # stable: equal counts keep their first appearance
        remedies = "; ".join(f"{counts[fix]}: {fix}" for fix in order)
        found = "; ".join(f"{name}: {why}" for fix in order for name, why, other in bad if other == fix)
        super().__init__(f"{len(bad)} bad image files ({remedies}; or {SKIP}): {found}")


def refuse_all(decoders) -> list:
    """What each of `decoders` (callables) returns; the bad files all of them found refused together."""
    results, bad = [], []
    for decode in decoders:
        try:
            results.append(decode())
        except BadImages as err:
            bad += err.bad
    if bad:
        raise BadImages(bad)
    return results


def shown(names: list[str] | tuple[str, ...]) -> str:
    """The first `SHOWN_BAD` of `names`, for a line that counts them all."""
    return ", ".join(names[:SHOWN_BAD]) + (", ..." if len(names) > SHOWN_BAD else "")
