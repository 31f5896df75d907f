"""What a command's exit status means, computed in one place from plain counts.

    0    all good (or nothing left to do)
    1    a bug: an unexpected error (please report it with the traceback)
    2    bad input or flags; nothing was run and nothing written
    3    done, but some records or turns failed or fell back to the extractive engine
         (``--allow-fallback`` turns this into 0)
    4    nothing succeeded: every record failed (none was written, even degraded), or every
         model turn of a single run failed
    3/4  also when a served corpus stops answering mid-run (deepr.cli.app.corpus_lost): the
         command stops, the units it finished count as ok and the rest as failed, unrejected
    5    the endpoint refused the credentials (HTTP 401/403); the command stopped at once
    130  interrupted; finished records are saved, re-run the same command to resume

Commands count units of their own kind (records for the data stages and eval, queries for
``run --queries``, model turns for a single ``run``) and call :func:`exit_code`.
"""

from __future__ import annotations

OK, BUG, USAGE, PARTIAL, NOTHING, AUTH, INTERRUPTED = 0, 1, 2, 3, 4, 5, 130


def exit_code(ok: int, degraded: int = 0, failed: int = 0, *, allow_fallback: bool = False,
              auth: bool = False) -> int:
    """``ok``: units done as intended; ``degraded``: written, but with failed turns or a fallback;
    ``failed``: units that produced nothing (a single run passes its failed turns here). ``auth``: credentials were refused."""
    if auth:
        return AUTH
    if allow_fallback:
        ok, degraded = ok + degraded, 0
    if degraded == 0 and failed == 0:
        return OK
    if ok == 0 and degraded == 0:  # a degraded unit was still written: that is a partial success
        return NOTHING
    return PARTIAL
