"""The waiting queue and who joins the running batch when.

Admission is budgeted in beam x tokens, as the batch holds them: every row's self-attention cache is
as wide as the longest output limit in the batch, so a batch costs the sum over its texts of
beam x (source + the batch's longest output limit), at most max_batch_tokens (batch_cost). That is
the memory the batch's caches need, whatever mix of short and long texts it holds: a short text
joining a long one is charged the long one's width. Each call's texts wait in their own line, first
come first served, and the next text admitted is chosen in three rules:

  1. Priority. The calls of the highest priority with texts waiting go first (the request's
     `priority`, MIN_PRIORITY..MAX_PRIORITY, 0 by default). This is strict: while a call of a
     higher priority waits, no text of a lower one is admitted, so a steady stream of urgent calls
     can hold back the rest; that is what asking for a priority means.
  2. Turns. Within a priority, calls take turns: admission takes one text from the call whose turn
     it is and passes the turn on. A one-text call is admitted after at most one text of each call
     of its priority ahead of it, however many texts those calls queued.
  3. The per-call cap. While other calls of its priority wait, a call that already holds
     call_share of the budget in the running batch is passed over (it keeps its place in the
     turns): the room its finishing texts free goes to the others. It never leaves the batch idle:
     with nobody else waiting, or every waiting call at its share, the call whose turn it is goes.

Bulk work gets part of the budget. The texts of calls of several texts (bulk) together hold at
most bulk_share of the budget (as batch_cost counts them alone), and the batch as a whole at most
the budget: one-text calls may fill the rest. Many one-text calls then decode in a wide batch,
which costs less per text, while a backlog of multi-text calls keeps its batch narrow, so that a
one-text call arriving behind it joins a batch that steps fast (python -m bench speed and python
-m bench server --scenario backlog measure the two sides). A bulk text that does not fit the
share yet is promised a step as below, reckoned over the bulk texts alone; one-text calls do not
touch that promise, so they may go before it as long as the whole budget holds them.

The text chosen waits until it fits, so a long text is never passed over forever. A sequence
larger than the whole budget runs alone. While it waits, the room it cannot use yet is not left
idle (backfilling, as batch schedulers do it): it is promised the step by which it surely fits,
reckoned from each running text's output limit (a text never decodes past it), and another call
of its priority may have its next text admitted meanwhile if that text fits now and either ends
by that step (its own output limit) or leaves the promised room free. So a call of a few short
texts is not held up for hundreds of steps behind a call of wide beams and long outputs, and the
waiting text still starts by the promised step (texts that end early can only bring it forward
when nothing was backfilled). Lower priorities never backfill: rule 1 stays strict.

Pacing. Under load (BUSY_TEXTS or more texts running) an engine may admit at every `every`-th
step only (admit's `every`; the engine's admission_interval chooses it by model): the texts that
arrived meanwhile are encoded in one pass. A pass has a fixed cost, and every pass leaves the next
decoder step to find its weights and caches evicted; for a model whose encoder does much besides
its layers (GRET's capsule routing and global-state graph) fewer, larger passes are cheaper per
text. A text waits at most every - 1 steps more; a lighter batch admits at every step, so a lone
caller's latency is untouched, and so does a batch with a waiting text promised a step (below).

Policies (the server benchmark compares them on one model):
  continuous  admit at every decoder step (continuous batching, the default)
  request     admit only into an empty batch, as many as fit (request-level dynamic batching)
  none        admit one sequence into an empty batch (no batching)
"""
from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field

from .sequence import Sequence

POLICIES = ("continuous", "request", "none")
MIN_PRIORITY, MAX_PRIORITY = -10, 10  # a request's priority; 0 when it names none
BUSY_TEXTS = 8  # a batch running this many texts is under load: admission may be paced (admit's `every`)

_calls = itertools.count()  # one number per line, unique across the process's schedulers


class QueueFull(Exception):
    pass


def batch_cost(seqs: list[Sequence]) -> int:
    """What a batch of these texts holds, in beam x tokens: each row its source and, in the
    self-attention cache, as many columns as the longest output limit in the batch (Load)."""
    return Load(seqs).cost()


def earliest_deadline(seqs, before: float = math.inf) -> float:
    """The earliest of the texts' deadlines and `before` (math.inf: none)."""
    return min([before] + [s.deadline for s in seqs if s.deadline is not None])


@dataclass(eq=False)
class Line:
    """One call's waiting texts, first come first served."""
    call: int
    priority: int
    texts: deque[Sequence] = field(default_factory=deque)


class Waiting:
    """Waiting texts: per priority, the calls' lines in turn order. Iterating gives every waiting text."""

    def __init__(self):
        self.levels: dict[int, deque[Line]] = {}
        self._count = 0
        # No waiting text's deadline is before this (exact after remove(); taking a text may leave it
        # early): until then, only a cancel can doom a waiting text, and nobody need look at them all.
        self.earliest = math.inf

    def add(self, seqs: list[Sequence]) -> None:
        """One call's texts (of one priority: its first text's) join the back of its priority's turns.
        Each text is marked with its call (Sequence.call), which the cap counts in the running batch,
        and as bulk if the call has several texts (Sequence.bulk), which the bulk share counts."""
        if not seqs:
            return
        line = Line(next(_calls), seqs[0].priority, deque(seqs))
        for s in seqs:
            s.call, s.bulk = line.call, len(seqs) > 1
        self.levels.setdefault(line.priority, deque()).append(line)
        self._count += len(seqs)
        self.earliest = earliest_deadline(seqs, self.earliest)

    def top(self) -> deque[Line]:
        """The lines of the highest priority that has texts waiting, in turn order."""
        return self.levels[max(self.levels)]

    def take(self, line: Line) -> Sequence:
        """Takes the line's first text; the line goes to the back of its priority's turns (or
        leaves, if that was its last text)."""
        level = self.levels[line.priority]
        level.remove(line)
        seq = line.texts.popleft()
        if line.texts:
            level.append(line)
        elif not level:
            del self.levels[line.priority]
        self._count -= 1
        return seq

    def remove(self, doomed) -> list[Sequence]:
        """Takes out the texts for which doomed(seq) is true (asked once each: a cancel may land
        meanwhile); the turn order stays."""
        gone, self.earliest = [], math.inf
        for priority, level in list(self.levels.items()):
            for line in level:
                kept = deque()
                for s in line.texts:
                    (gone if doomed(s) else kept).append(s)
                line.texts = kept
                self.earliest = earliest_deadline(kept, self.earliest)
            level = deque(line for line in level if line.texts)
            if level:
                self.levels[priority] = level
            else:
                del self.levels[priority]
        self._count -= len(gone)
        return gone

    def clear(self) -> None:
        self.levels.clear()
        self._count = 0
        self.earliest = math.inf

    def __iter__(self):
        lines = [line for level in list(self.levels.values()) for line in list(level)]
        return itertools.chain.from_iterable(list(line.texts) for line in lines)

    def __len__(self) -> int:
        return self._count


class Scheduler:
    def __init__(self, policy: str = "continuous", max_batch_tokens: int = 16384, max_waiting: int = 1024,
                 call_share: float = 1.0, bulk_share: float = 1.0):
        if policy not in POLICIES:
            raise ValueError(f"unknown batching policy {policy!r}: choose from {', '.join(POLICIES)}")
        for name, share in (("call_share", call_share), ("bulk_share", bulk_share)):
            if not 0 < share <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {share}")
        self.policy, self.max_batch_tokens, self.max_waiting = policy, max_batch_tokens, max_waiting
        self.share = call_share * max_batch_tokens  # of the budget, what one call may hold while others wait
        self.bulk = bulk_share * max_batch_tokens  # what the texts of calls of several texts may hold together
        self.waiting = Waiting()
        self.promise: tuple[Sequence, int] | None = None  # the last admission's: (waiting text, by which step)

    def add(self, seqs: list[Sequence]) -> None:
        """One call's texts: all are queued, or none (QueueFull)."""
        if len(self.waiting) + len(seqs) > self.max_waiting:
            raise QueueFull(f"the queue holds {len(self.waiting)} texts and admits at most {self.max_waiting}; "
                            f"this request has {len(seqs)}: retry later")
        self.waiting.add(seqs)

    def admit(self, running: list[Sequence], clock: int = 0, every: int = 1) -> list[Sequence]:
        """Sequences to join a batch that holds `running`; `clock` is the engine's step count, from
        which each running text's steps left follow (Sequence.joined). Under load, none but at
        steps that are multiples of `every` (pacing, above)."""
        if self.policy != "continuous" and running:
            return []
        if clock % every and len(running) >= BUSY_TEXTS and self.promise is None:
            return []
        batch, bulk, budget = Load(running), Load([s for s in running if s.bulk]), self.max_batch_tokens

        def over_share(line: Line) -> bool:  # a bulk text the bulk share cannot hold yet
            return line.texts[0].bulk and bulk.cost(line.texts[0]) > self.bulk

        def fits(line: Line) -> bool:
            return batch.cost(line.texts[0]) <= budget and not over_share(line)

        held = Counter()  # each call's own budget (Sequence.rows_budget) in the batch: what the cap counts
        for s in running:
            held[s.call] += s.rows_budget
        admitted, promise, self.promise = [], None, None
        while self.waiting:
            if promise is None:
                line = self.next_line(held)
                if not fits(line) and (running or admitted):
                    if self.policy != "continuous" or not any(other is not line and fits(other)
                                                              for other in self.waiting.top()):
                        break  # nothing could go before it
                    # a promise of room in the whole batch, or, if the bulk share alone holds the
                    # text back, of room in the share (over the bulk texts alone)
                    in_share = batch.cost(line.texts[0]) <= budget
                    texts = [(s.max_len - (clock - s.joined), s) for s in running] + [(s.max_len, s) for s in admitted]
                    promise = Promise(line, [(left, s) for left, s in texts if s.bulk or not in_share],
                                      self.bulk if in_share else budget, bulk=in_share)
                    self.promise = promise.head, clock + promise.at
                    continue
            else:
                line = promise.backfill(self.waiting, held, self.share, fits)
                if line is None:
                    break
                promise.add(line.texts[0])
            seq = self.waiting.take(line)
            admitted.append(seq)
            batch.add(seq)
            if seq.bulk:
                bulk.add(seq)
            held[line.call] += seq.rows_budget
            if self.policy == "none":
                break
        return admitted

    def next_line(self, held: Counter) -> Line:
        """Rules 1-3: in the highest priority waiting, the first line in turn whose call holds less
        than its share of the batch; if every one holds its share, the first in turn."""
        lines = self.waiting.top()
        return next((line for line in lines if held[line.call] < self.share), lines[0])

    def drop(self, doomed) -> list[Sequence]:
        """Remove waiting sequences for which doomed(seq) is true; returns them."""
        return self.waiting.remove(doomed)

    def __len__(self) -> int:
        return len(self.waiting)


class Load:
    """batch_cost's terms for a batch's texts, kept up to date as texts join."""

    def __init__(self, seqs: list[Sequence]):
        self.beams = sum(s.options.beam for s in seqs)
        self.sources = sum(s.options.beam * len(s.src) for s in seqs)
        self.width = max((s.max_len for s in seqs), default=0)

    def add(self, seq: Sequence) -> None:
        self.beams += seq.options.beam
        self.sources += seq.options.beam * len(seq.src)
        self.width = max(self.width, seq.max_len)

    def cost(self, seq: Sequence | None = None) -> int:
        """batch_cost of the batch, with `seq` added."""
        if seq is None:
            return self.sources + self.beams * self.width
        beam = seq.options.beam
        return self.sources + beam * len(seq.src) + (self.beams + beam) * max(self.width, seq.max_len)


class Promise:
    """For a waiting text that does not fit yet: the step by which it surely does (`at`, in steps
    from now: once every text that could still be running then leaves it room), and the batch it
    will join then at the most (`then`: itself and the texts that may outlive that step)."""

    def __init__(self, line: Line, steps_left: list[tuple[int, Sequence]], budget: float, bulk: bool = False):
        self.line, self.head, self.budget = line, line.texts[0], budget
        self.bulk = bulk  # a promise of room within the bulk share: the bulk texts' alone
        texts = sorted(steps_left, key=lambda t: -t[0])  # most steps left first
        self.at = texts[0][0] if texts else 0  # at the latest once all have left (it may run alone)
        stay = Load([self.head])
        for left, seq in texts:  # with the texts before this one staying, it fits once this one has left
            if stay.cost() > budget:
                break
            self.at = left
            stay.add(seq)
        self.then = Load([self.head] + [seq for left, seq in texts if left > self.at])

    def keeps(self, seq: Sequence) -> bool:
        """Admitting `seq` now keeps the promise: it ends by the step, or leaves the room free (a
        one-text call always keeps a bulk promise: it takes none of the bulk share)."""
        return (self.bulk and not seq.bulk) or seq.max_len <= self.at or self.then.cost(seq) <= self.budget

    def add(self, seq: Sequence) -> None:
        """A backfilled text: part of the batch at the promised step if it may still be running."""
        if seq.max_len > self.at and (seq.bulk or not self.bulk):
            self.then.add(seq)

    def backfill(self, waiting: Waiting, held: Counter, share: float, fits) -> Line | None:
        """The next line of the waiting text's priority whose first text may go before it (it
        fits(line) now and keeps the promise): in turn, a call below its share first (rule 3), else
        any; None if none may."""
        fallback = None
        for line in waiting.levels.get(self.head.priority, ()):
            seq = line.texts[0]
            if line is not self.line and fits(line) and self.keeps(seq):
                if held[line.call] < share:
                    return line
                fallback = fallback or line
        return fallback
