"""Branch points of vllm-mlx's scheduler on state-layer models (issue 26).

A request whose whole blocks match a stored prompt's up to ``m`` tokens but which resumed at an
earlier checkpoint (a stride multiple, a stored length, or none) is checkpointed at its branch
point, the last block boundary ``b <= m`` (``resume.branch_point``: one ``PrefixCache.longest``),
so the next request that branches there, on any server, resumes at ``b``. vllm-mlx 0.6 inserts
each request into mlx-lm 0.31's ``BatchGenerator`` as one segment; before each ``next()``, when a
request is the only one in the prompt stage (prefilled alone), ``Branches.cut`` asks for its
branch point once and, when its next chunk would run past it, cuts its segment there (the
segment list mlx-lm keeps for it, in place), so that chunk ends at ``b``; ``reached`` tells
``chunk_stores`` which chunk ended there and hides that segment end (vllm-mlx's scheduler reads
only the generation responses). Requests prefilled with others get no cut: their state already
differs from a lone run's and is not stored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mlxcache.integrations.resume import branch_point

log = logging.getLogger("mlxcache")
KEEP = 4096  # requests remembered; past it all are forgotten (a branch point missed, no more)


class Branches:
    """The branch points of one ``BatchGenerator``'s requests (uid -> (restored, branch point)),
    found when each request is first prefilled alone, until its prefill passes them."""

    def __init__(self, scheduler: Any, generator: Any, batched: set[int]) -> None:
        self._scheduler, self._generator, self._batched = scheduler, generator, batched
        self._marks: dict[int, tuple[int, int]] = {}
        self._asked: set[int] = set()
        self.cuts = 0  # chunks ended at a branch point

    def cut(self) -> None:
        """Before a step: end the lone prompt's next chunk at its branch point, if it passes it
        (a failure is a log line: the step runs as vllm-mlx's own)."""
        if len(self._asked) > KEEP:  # requests aborted mid-prefill never reach their end
            self._asked.clear()
            self._marks.clear()
        try:
            self._cut()
        except Exception as e:  # never into the scheduler
            log.warning("vllm-mlx shared tier: a branch point was not cut: %s", e)

    def _cut(self) -> None:
        gen = self._generator
        pending = getattr(gen, "_unprocessed_sequences", None)
        processing = getattr(gen, "_currently_processing", None)
        if pending is None or processing is None or len(pending) + len(processing) != 1:
            return  # mlx-lm other than 0.31's, or prompts prefilled together (or none)
        if processing:
            uid, (segments, done, _) = gen._prompt_batch.uids[0], processing[0]
        else:
            uid, segments, done = pending[0][0], pending[0][1], 0
        if uid in self._batched:
            return
        if uid not in self._asked:
            self._asked.add(uid)
            self._find(uid)
        mark = self._marks.get(uid)
        if mark is None or not segments:
            return
        p, first = mark[0] + done, segments[0]
        k = min(len(first), gen.prefill_step_size)  # mlx-lm's next chunk: [p, p + k)
        if p < mark[1] < p + k:
            segments[0:1] = [first[: mark[1] - p], first[mark[1] - p :]]

    def _find(self, uid: int) -> None:
        """Ask for a request's branch point (one ``longest`` on its tier)."""
        scheduler = self._scheduler
        request = scheduler.running.get(scheduler.uid_to_request_id.get(uid))
        tier_of = getattr(getattr(scheduler, "memory_aware_cache", None), "_tier", None)
        if request is None or tier_of is None:
            return
        prompt = list(request.prompt_token_ids or [])
        start = request.cached_tokens or 0
        tier = tier_of(getattr(request, "mlxcache_salt", ""))
        at = branch_point(tier.prefix, prompt[:-1], (), start) if len(prompt) > 1 else 0
        if at:
            self._marks[uid] = (start, at)

    def reached(self, prompt_responses: Sequence[Any]) -> dict[int, int]:
        """The requests whose chunk just ended at their branch point (uid -> branch point);
        the segment end cut there is reset, as vllm-mlx never made it."""
        out = {}
        for r in prompt_responses:
            if r.end_of_prompt:
                self._asked.discard(r.uid)
            mark = self._marks.get(r.uid)
            if mark is None:
                continue
            n = mark[0] + r.progress[0]
            if n == mark[1] and r.uid not in self._batched:
                r.end_of_segment = False
                out[r.uid] = mark[1]
                self.cuts += 1
            if n >= mark[1] or r.end_of_prompt:
                del self._marks[r.uid]
        return out
