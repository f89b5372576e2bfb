"""The engine driven in this process as N callers would drive a server: a closed loop in which a
finished text is replaced at once (python -m bench step, python -m bench gpu)."""
from __future__ import annotations

import time

from server.engine.engine import PHASES, Engine, Observer
from server.engine.options import DecodingOptions, Limits
from server.engine.sequence import Sequence

BEAM = 4


class Rows(Observer):
    def __init__(self):
        self.rows = 0

    def stepped(self, rows: int, seconds: float) -> None:
        self.rows += rows


def closed_loop(engine: Engine, sources: list[tuple[list[int], list[int] | None]], in_flight: int, texts: int,
                best: dict[int, list[int]] | None = None) -> dict:
    """`texts` texts through the engine (its observer a Rows) with `in_flight` of them queued or
    running at any time; sources: (piece ids, POS tags or None) per text, taken in turn. With
    `best`, each source's best hypothesis is written into it by the source's index."""
    options = DecodingOptions(beam=BEAM)
    cfg, issued, finished = engine.backend.cfg, [0], [0]

    def submit() -> None:
        index = issued[0] % len(sources)
        src, tags = sources[index]
        issued[0] += 1
        limit = options.output_limit(len(src), cfg.max_positions - 1, Limits())
        engine.enqueue([Sequence(src, options, limit, on_done=lambda seq: done(index, seq), tags=tags)])

    def done(index: int, seq: Sequence) -> None:
        finished[0] += 1
        if best is not None:
            best[index] = seq.hypotheses[0].tokens if seq.hypotheses else []
        if issued[0] < texts:
            submit()

    for _ in range(in_flight):
        submit()
    for _ in range(10):  # the batch fills and the arenas warm before timing
        engine.iterate()
    seconds, steps, rows, count = dict(engine.seconds), engine.steps, engine.observer.rows, finished[0]
    start = time.perf_counter()
    engine.run_until_idle()
    wall = time.perf_counter() - start
    n = engine.steps - steps
    return {"in_flight": in_flight, "steps": n, "rows": round((engine.observer.rows - rows) / n, 1),
            "texts_per_s": round((finished[0] - count) / wall, 1),
            "ms": {k: round((engine.seconds[k] - seconds[k]) / n * 1e3, 3) for k in PHASES}}
