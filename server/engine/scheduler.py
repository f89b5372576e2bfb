"""The waiting queue and who joins the running batch when.

Admission is budgeted in beam x tokens (Sequence.rows_budget: beam x (source + output limit)),
first come first served: the head of the queue waits until it fits, so a long request is never
overtaken forever. A sequence larger than the whole budget runs alone.

Policies (the server benchmark compares them on one model):
  continuous  admit at every decoder step (continuous batching, the default)
  request     admit only into an empty batch, as many as fit (request-level dynamic batching)
  none        admit one sequence into an empty batch (no batching)
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence

POLICIES = ("continuous", "request", "none")


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, policy: str = "continuous", max_batch_tokens: int = 16384, max_waiting: int = 1024):
        if policy not in POLICIES:
            raise ValueError(f"unknown batching policy {policy!r}: choose from {', '.join(POLICIES)}")
        self.policy, self.max_batch_tokens, self.max_waiting = policy, max_batch_tokens, max_waiting
        self.waiting: deque[Sequence] = deque()

    def add(self, seqs: list[Sequence]) -> None:
        """All of a request's texts are queued, or none (QueueFull)."""
        if len(self.waiting) + len(seqs) > self.max_waiting:
            raise QueueFull(f"the queue holds {len(self.waiting)} texts and admits at most {self.max_waiting}; "
                            f"this request has {len(seqs)}: retry later")
        self.waiting.extend(seqs)

    def admit(self, running: int, used: int) -> list[Sequence]:
        """Sequences to join a batch of `running` sequences that uses `used` budget."""
        if self.policy != "continuous" and running:
            return []
        admitted = []
        while self.waiting:
            head = self.waiting[0]
            fits = used + head.rows_budget <= self.max_batch_tokens
            if not fits and (running or admitted):
                break
            admitted.append(self.waiting.popleft())
            used += head.rows_budget
            if self.policy == "none":
                break
        return admitted

    def drop(self, doomed) -> list[Sequence]:
        """Remove waiting sequences for which doomed(seq) is true; returns them."""
        keep, gone = deque(), []
        for s in self.waiting:
            (gone if doomed(s) else keep).append(s)
        self.waiting = keep
        return gone

    def __len__(self) -> int:
        return len(self.waiting)
