"""Bad image files gathered over a whole dataset before anything is refused, so that a run
names every one in one refusal instead of one per run (each run costs a minute or more)."""

from __future__ import annotations

SHOWN_BAD = 3  # bad files named in the warning that counts the skipped ones


class BadImages(ValueError):
    """Every bad file of a dataset, (path, what is wrong, what to do) each, in one line."""

    def __init__(self, bad: list[tuple[str, str, str]]):
        self.bad = bad
        fixes = ", ".join(dict.fromkeys(fix for _, _, fix in bad))
        found = "; ".join(f"{name}: {why}" for name, why, _ in bad)
        count = f"{len(bad)} bad image files: " if len(bad) > 1 else ""
        super().__init__(f"{count}{found}; {fixes}, or set skip-bad-images=true to leave such files out")


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
