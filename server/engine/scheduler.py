"""The waiting queue and who joins the running batch when.

Admission is budgeted in beam x tokens (Sequence.rows_budget: beam x (source + output limit)).
Calls take turns: each call's texts wait in their own first-come-first-served line, and admission
takes one text from the call whose turn it is, then passes the turn on. So a one-text call is
admitted after at most one text of each call ahead of it, however many texts those calls queued.
The text whose turn it is waits until it fits, so a long text is never overtaken forever. A
sequence larger than the whole budget runs alone.

Policies (the server benchmark compares them on one model):
  continuous  admit at every decoder step (continuous batching, the default)
  request     admit only into an empty batch, as many as fit (request-level dynamic batching)
  none        admit one sequence into an empty batch (no batching)
"""
from __future__ import annotations

import itertools
from collections import deque

from .sequence import Sequence

POLICIES = ("continuous", "request", "none")


class QueueFull(Exception):
    pass


class TakingTurns:
    """Waiting texts, one line per call, the calls in turn. Iterating gives every waiting text."""

    def __init__(self):
        self.lines: deque[deque[Sequence]] = deque()
        self._count = 0

    def add(self, seqs: list[Sequence]) -> None:
        if seqs:
            self.lines.append(deque(seqs))
            self._count += len(seqs)

    def head(self) -> Sequence:
        """The text whose turn it is."""
        return self.lines[0][0]

    def pop(self) -> Sequence:
        """Takes the head; its call goes to the back of the turn order (or leaves, if done)."""
        line = self.lines.popleft()
        seq = line.popleft()
        if line:
            self.lines.append(line)
        self._count -= 1
        return seq

    def remove(self, doomed) -> list[Sequence]:
        """Takes out the texts for which doomed(seq) is true (asked once each: a cancel may land
        meanwhile); the turn order stays."""
        lines, gone = deque(), []
        for line in self.lines:
            kept = deque()
            for s in line:
                (gone if doomed(s) else kept).append(s)
            if kept:
                lines.append(kept)
        self.lines = lines
        self._count -= len(gone)
        return gone

    def clear(self) -> None:
        self.lines.clear()
        self._count = 0

    def __iter__(self):
        return itertools.chain.from_iterable(list(self.lines))

    def __len__(self) -> int:
        return self._count


class Scheduler:
    def __init__(self, policy: str = "continuous", max_batch_tokens: int = 16384, max_waiting: int = 1024):
        if policy not in POLICIES:
            raise ValueError(f"unknown batching policy {policy!r}: choose from {', '.join(POLICIES)}")
        self.policy, self.max_batch_tokens, self.max_waiting = policy, max_batch_tokens, max_waiting
        self.waiting = TakingTurns()

    def add(self, seqs: list[Sequence]) -> None:
        """One call's texts: all are queued, or none (QueueFull)."""
        if len(self.waiting) + len(seqs) > self.max_waiting:
            raise QueueFull(f"the queue holds {len(self.waiting)} texts and admits at most {self.max_waiting}; "
                            f"this request has {len(seqs)}: retry later")
        self.waiting.add(seqs)

    def admit(self, running: int, used: int) -> list[Sequence]:
        """Sequences to join a batch of `running` sequences that uses `used` budget."""
        if self.policy != "continuous" and running:
            return []
        admitted = []
        while self.waiting:
            head = self.waiting.head()
            fits = used + head.rows_budget <= self.max_batch_tokens
            if not fits and (running or admitted):
                break
            admitted.append(self.waiting.pop())
            used += head.rows_budget
            if self.policy == "none":
                break
        return admitted

    def drop(self, doomed) -> list[Sequence]:
        """Remove waiting sequences for which doomed(seq) is true; returns them."""
        return self.waiting.remove(doomed)

    def __len__(self) -> int:
        return len(self.waiting)
