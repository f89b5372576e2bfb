"""Data-parallel training: the training CLI under torchrun (2 processes, gloo on CPU) takes the same
optimiser steps as one process on the same global batches, every process ends with the same
weights, and the state it saves resumes in a single process as if it had been one all along."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training import distributed, train
from training.data import TokenBatcher

ROOT = Path(__file__).resolve().parents[1]
# fp32 and no dropout, so that one process and two compute the same function of the same batches.
ARGS = ["--preset", "tiny", "--train-limit", "40", "--valid-limit", "2", "--vocab-size", "200",
        "--batch-tokens", "400", "--lr", "3e-3", "--warmup", "10", "--threads", "1", "--log-every", "1",
        "--dropout", "0", "--precision", "fp32"]
# The log rounds losses and gradient norms to 4 decimals. The two runs add the same numbers in
# another order (per-process partial sums), so their values lie a few fp32 ulps apart (measured:
# under 1e-6 over 30 steps) and may print one rounding unit apart. The mistakes this guards against
# are far larger: gradients averaged instead of summed over processes halve the norm; a mean of
# per-process means instead of the global token mean moves the loss by 2e-4 to 7e-4 within 4 steps.
TOLERANCE = 1.5e-4


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def train_steps(log: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in log if r["event"] == "train"}


def run_train(out: Path, *extra: str) -> list[dict]:
    train.main(["--out", str(out), *ARGS, *extra])
    return read_log(out)


def torchrun(out: Path, *extra: str) -> list[dict]:
    """The real CLI in 2 processes; --standalone lets the OS choose a free loopback port for the
    rendezvous, so concurrent test runs do not collide."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "training.train", "--out", str(out), *ARGS, *extra]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_log(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process for 12 steps; two processes for 8 steps, that state then resumed in one process
    to 12 (one launch only: each costs about 15 CPU-seconds)."""
    single = run_train(tmp_path_factory.mktemp("single"), "--max-steps", "12", "--eval-every", "12")
    out = tmp_path_factory.mktemp("parallel")
    parallel = torchrun(out, "--max-steps", "8", "--eval-every", "4")
    resumed = run_train(out, "--max-steps", "12", "--eval-every", "4")[len(parallel):]
    return single, parallel, resumed


def assert_steps_match(log: list[dict], single: list[dict], expected: range):
    steps, reference = train_steps(log), train_steps(single)
    assert sorted(steps) == list(expected)
    for step, record in steps.items():
        for key in ("loss", "grad_norm"):
            assert record[key] == pytest.approx(reference[step][key], abs=TOLERANCE), (step, key)


@pytest.mark.slow
def test_both_processes_end_with_identical_weights(runs):
    done = runs[1][-1]
    assert done["event"] == "done"
    assert len(done["weights_sha256"]) == 2 and len(set(done["weights_sha256"])) == 1, done


@pytest.mark.slow
def test_losses_and_gradient_norms_match_one_process_on_the_same_global_batches(runs):
    single, parallel, _ = runs
    assert_steps_match(parallel, single, range(1, 9))


@pytest.mark.slow
def test_the_state_two_processes_saved_resumes_in_one(runs):
    single, _, resumed = runs
    assert_steps_match(resumed, single, range(9, 13))


def test_a_batch_is_dealt_longest_first_to_the_lighter_share():
    src, tgt = [[5] * n for n in (9, 3, 7, 7, 2, 8, 4)], [[5] * n for n in (6, 2, 5, 4, 3, 7, 2)]
    batcher, batch = TokenBatcher(src, tgt, max_tokens=1000), [6, 0, 3, 1, 5, 2, 4]
    # tokens per pair: 0:15 5:15 2:12 3:11 6:6 1:5 4:5 (dealt in this order); shares keep batch order
    assert [batcher.shard(batch, rank, 2) for rank in (0, 1)] == [[0, 1, 2, 4], [6, 3, 5]]  # 37 + 32 tokens
    assert batcher.shard(batch, 0, 1) == batch  # one process: the batch as it is


def test_asking_for_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        distributed.start("cuda")
