"""What both fuzzers' campaigns do alike: send a batch of cases to the ranks and get one
verdict per case, and shrink a failing case greedily."""

from __future__ import annotations

from typing import Callable, Iterable

from tests.opinfo.pool import Ranks


def run_cases(ranks: Ranks, cases: list, message: Callable[[list], object],
              timeout_s: float) -> list[tuple[str, str]]:
    """One verdict per case: the ranks' common answer (ok, wrong, error, ...), or hang,
    crash or divergent. ``message(cases)`` is what the ranks' handler takes; a batch that
    hangs or crashes is run again one case at a time, to find the culprit."""
    reply = ranks.call(message(cases), timeout_s)
    if reply.kind != "ok":
        if len(cases) == 1:
            return [(reply.kind, reply.message)]
        return [v for c in cases for v in run_cases(ranks, [c], message, timeout_s)]
    per_rank = [reply.values[r] for r in range(ranks.world)]
    verdicts = []
    for k in range(len(cases)):
        if len({tuple(answer[k]) for answer in per_rank}) == 1:
            verdicts.append(tuple(per_rank[0][k]))
        else:  # ranks that disagree about a verdict would deadlock a real program
            verdicts.append(("divergent", " | ".join(f"rank {r}: {per_rank[r][k]}" for r in range(ranks.world))))
    return verdicts


def shrink(case, kind: str, candidates: Callable[[object], Iterable], verdict: Callable[[object], str],
           budget: int) -> object:
    """A smaller case that still fails with the same kind of verdict: the first of
    ``candidates(case)`` that does is taken, and its own candidates tried, until none
    does or ``budget`` runs are spent."""
    tries, improved = 0, True
    while improved and tries < budget:
        improved = False
        for candidate in candidates(case):
            tries += 1
            if verdict(candidate) == kind:
                case, improved = candidate, True
                break
            if tries >= budget:
                break
    return case
