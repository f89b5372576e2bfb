"""Training CLI: python -m training.train --out DIR [--preset small] [--src de --tgt en] ...

The output directory is a checkpoint (config.json + model.safetensors + spm.model, the best by
validation BLEU/ROUGE) plus what resuming needs (state/) and a JSONL log. Re-running the same
command resumes exactly where the last saved state left off.

Data-parallel: `torchrun --standalone --nproc_per_node N -m training.train ...` runs the same
command in N processes (training.distributed); each computes its share of every batch."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .corpora import load_examples
from .data import TokenBatcher, encode_target, length_filter, train_sentencepiece
from .decode import corpus_translate
from .distributed import Processes, start
from .metrics import bleu, rouge
from .seq2seq import checkpoint as ck
from .seq2seq.config import PRESETS, Checkpoint, DataConfig, ModelConfig
from .seq2seq.inputs import PAD, align_tags, encode_source, load_sentencepiece
from .seq2seq.model import Seq2Seq
from .seq2seq.positions import choose_mvpe_k

VALID_SPLIT = {"multi30k": "val", "gigaword": "valid", "aeslc": "dev"}


def every(text: str) -> int:
    """An interval in steps: a positive integer."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--dataset", default="multi30k", choices=("multi30k", "gigaword", "aeslc"))
    p.add_argument("--src", default="de")
    p.add_argument("--tgt", default="en")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-src-len", type=int, default=128)
    p.add_argument("--max-tgt-len", type=int, default=128)
    p.add_argument("--train-limit", type=int, default=0, help="use only the first N training pairs")
    p.add_argument("--valid-limit", type=int, default=0, help="validate on the first N pairs only")
    # optimisation
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--max-minutes", type=float, default=0, help="also stop after this wall time")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=800)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 autocast for matmuls (fp32 weights and loss); faster on CPUs with AVX512-BF16")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="per process")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per process (LOCAL_RANK under torchrun), NCCL between them; cpu: gloo")
    p.add_argument("--eval-every", type=every, default=1000)
    p.add_argument("--log-every", type=every, default=100)
    p.add_argument("--save-every", type=every, default=100,
                   help="save the resumable state every N steps (a kill loses at most N steps), besides every evaluation")
    p.add_argument("--average-last", type=int, default=5, help="average the last k evaluated snapshots")
    p.add_argument("--init-from", type=Path, help="warm start: load this checkpoint, add new modules")
    # architecture switches (docs/MODEL.md, docs/GRET.md)
    p.add_argument("--post-norm", action="store_true")
    p.add_argument("--gret", default="", help="comma list of capsule,aggregate,gate (or 'full')")
    p.add_argument("--pooling", choices=("attentive", "mean"))
    p.add_argument("--capsules", type=int)
    p.add_argument("--routing-iters", type=int)
    p.add_argument("--capsule-dim", type=int)
    p.add_argument("--global-norm", action="store_true", help="GRET: LayerNorm on every x^m and on s^M")
    p.add_argument("--global-zero-bias", action="store_true", help="GRET: FFN_q / FFN_o biases start at zero")
    p.add_argument("--routing-scale", action="store_true", help="GRET: routing logits divided by sqrt(D)")
    p.add_argument("--global-dropout", type=float, help="GRET: dropout on s^M while training")
    p.add_argument("--global-bow", type=float, default=0.0,
                   help="GRET: weight of an auxiliary loss that predicts the target's words from s^M "
                        "through the tied output embedding (0: off, the paper's training)")
    p.add_argument("--gate-bias-init", type=float, help="the context gate's initial bias (default -3: a warm-started "
                                                         "model starts near its baseline; 0 is the usual init)")
    p.add_argument("--multiview", choices=("gca", "gpa", "fga", "fma", "ama"))
    p.add_argument("--multiview-replace", action="store_true", help="direct replacement, not soft")
    p.add_argument("--mvpe", action="store_true", help="mvPE with k from the 99%%-of-plateau rule")
    p.add_argument("--pos-tags", action="store_true", help="source-side POS-tag embeddings")
    p.add_argument("--encoder", choices=("transformer", "graph"), default="transformer")
    p.add_argument("--graph-fusion", choices=("sum", "weight_gate", "self_gate"))
    p.add_argument("--graph-half-dim", action="store_true")
    p.add_argument("--graph-shared-qkv", action="store_true")
    return p.parse_args(argv)


def model_config(args, vocab_size: int, base: ModelConfig | None) -> ModelConfig:
    cfg = base or ModelConfig(**PRESETS[args.preset])
    cfg = replace(cfg, vocab_size=vocab_size)
    flags = {"capsule", "aggregate", "gate"} if args.gret == "full" else set(filter(None, args.gret.split(",")))
    if flags - {"capsule", "aggregate", "gate"}:
        raise SystemExit(f"--gret takes capsule,aggregate,gate or full, not {args.gret!r}")
    changes = dict(capsule="capsule" in flags or cfg.capsule, aggregate="aggregate" in flags or cfg.aggregate,
                   gate="gate" in flags or cfg.gate)
    if base is None:
        changes.update(pre_norm=not args.post_norm, encoder=args.encoder,
                       graph_half_dim=args.graph_half_dim, graph_shared_qkv=args.graph_shared_qkv)
    for name in ("pooling", "capsules", "routing_iters", "capsule_dim", "gate_bias_init", "dropout", "graph_fusion",
                 "global_dropout"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    for name in ("global_norm", "global_zero_bias", "routing_scale"):
        if getattr(args, name):
            changes[name] = True
    if args.multiview:
        changes.update(multiview=args.multiview, multiview_soft=not args.multiview_replace)
    if args.mvpe:
        changes["pe_k"] = choose_mvpe_k(cfg.d_model, 100)
    if args.pos_tags:
        changes["pos_tags"] = True
    if base is None:
        changes["max_positions"] = max(args.max_src_len, args.max_tgt_len) + 2
    return replace(cfg, **changes).validate()


class Progress:
    """One status line on stderr: step, loss, tokens/s, ETA."""

    def __init__(self, total: int, minutes: float):
        self.total, self.deadline = total, minutes * 60 if minutes else None
        self.start = time.time()

    def show(self, step: int, first_step: int, loss: float, tok_per_s: float):
        elapsed = time.time() - self.start
        done = (step - first_step) / max(1, self.total - first_step)
        if self.deadline:
            done = max(done, elapsed / self.deadline)
        eta = elapsed * (1 - done) / max(done, 1e-9)
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        sys.stderr.write(f"\r[{bar}] step {step}/{self.total} loss {loss:.3f} "
                         f"{tok_per_s / 1000:.1f}k tok/s ETA {eta / 60:.1f} min ")
        sys.stderr.flush()


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor,
                        smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed over the non-pad target tokens, and their count: the caller divides by the whole
    batch's count, which data-parallel processes only know together."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=PAD,
                           label_smoothing=smoothing, reduction="sum")
    return loss, target.ne(PAD).sum().to(loss.dtype)


def bag_of_words_loss(word_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed over the non-pad target tokens: -log p(y | s^M) with p a softmax over the vocabulary,
    one distribution per sentence. It makes s^M carry the sentence's own target words, in the very
    space where GRET's output term adds s^M to the decoder state."""
    log_p = torch.log_softmax(word_logits.float(), -1).gather(1, target)
    return -(log_p * target.ne(PAD)).sum()


def rng_key(name: str, rank: int) -> str:
    """Each process's random stream in state/rng.safetensors (rank 0's under the plain name)."""
    return name if rank == 0 else f"{name}.rank{rank}"


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class Trainer:
    def __init__(self, args, procs: Processes):
        self.args, self.procs = args, procs
        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.out / "state"
        resuming = (self.state_dir / "optimizer.safetensors").exists()
        base_cfg, record, parent = None, {}, None
        if resuming:  # the run's own config, data and vocabulary
            saved = Checkpoint.load(self.out)
            base_cfg, record, self.data_cfg = saved.model, saved.training, saved.data
        elif args.init_from:  # continued learning keeps the parent's data and vocabulary
            parent = Checkpoint.load(args.init_from)
            base_cfg = parent.model
            self.data_cfg = parent.data
            weights = hashlib.sha256((args.init_from / ck.WEIGHTS).read_bytes()).hexdigest()
            record["init_from"] = {"path": str(args.init_from), "steps": parent.training.get("steps"),
                                   "wall_minutes": parent.training.get("wall_minutes"), "weights_sha256": weights}
        else:
            summarize = args.dataset != "multi30k"
            self.data_cfg = DataConfig(task="summarize" if summarize else "translate", dataset=args.dataset,
                                       src_lang="en" if summarize else args.src,
                                       tgt_lang="en" if summarize else args.tgt, vocab_size=args.vocab_size,
                                       max_src_len=args.max_src_len, max_tgt_len=args.max_tgt_len)
        data = self.data_cfg
        train = load_examples(data.dataset, "train", data.src_lang, data.tgt_lang)[: args.train_limit or None]
        self.valid = load_examples(data.dataset, VALID_SPLIT[data.dataset], data.src_lang,
                                   data.tgt_lang)[: args.valid_limit or None]
        if resuming:
            self.spm_bytes = (self.out / ck.SPM).read_bytes()
        elif parent is not None:
            self.spm_bytes = (args.init_from / ck.SPM).read_bytes()
        else:  # trained once and shared: every process must hold the same vocabulary
            texts = [e.source for e in train] + [e.target for e in train]  # joint vocabulary
            self.spm_bytes = procs.from_main(train_sentencepiece(texts, args.vocab_size) if procs.is_main else None)
        self.sp = load_sentencepiece(self.spm_bytes)
        cfg = base_cfg if resuming else model_config(args, self.sp.get_piece_size(), base_cfg)
        self.model = Seq2Seq(cfg).to(procs.device)  # the same initial weights in every process
        if procs.rank:  # but each process its own dropout stream (rank 0 keeps the single-process one)
            torch.manual_seed(args.seed + procs.rank)
        self.generators = {"torch_rng": torch} | ({"cuda_rng": torch.cuda} if procs.device.type == "cuda" else {})
        self.ckpt = Checkpoint(cfg, self.data_cfg, record)
        if args.global_bow and self.model.global_state is None:
            raise SystemExit("--global-bow needs a GRET model with a global state (--gret capsule or aggregate)")

        kept = length_filter(train, self.sp, data.max_src_len, data.max_tgt_len, data.task == "summarize")
        dropped, train = len(train) - len(kept), kept
        src = [encode_source(self.sp, e.source, data.max_src_len) for e in train]
        tgt = [encode_target(self.sp, e.target, data.max_tgt_len) for e in train]
        self.src_tags = self.valid_tags = None
        if cfg.pos_tags:
            from .seq2seq.pos_tags import tag_corpus  # slow to import: only for POS models

            self.src_tags = align_tags(tag_corpus([e.source for e in train], data.src_lang, self.sp), src)
            self.valid_tags = tag_corpus([e.source for e in self.valid], data.src_lang, self.sp)
        self.batcher = TokenBatcher(src, tgt, args.batch_tokens, seed=args.seed, tags=self.src_tags)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
        self.step, self.epoch, self.batch_in_epoch, self.best = 0, 0, 0, -1.0
        self.wall = 0.0  # training seconds so far, across resumes
        if resuming:
            self.resume()
        else:
            if args.init_from:
                added = ck.warm_start(self.model, args.init_from)
                self.ckpt.training["added_parameters"] = added
            self.log({"event": "start", "parameters": self.model.num_parameters(), "config": cfg.to_dict(),
                      "data": asdict(self.data_cfg), "train_pairs": len(src), "dropped_by_length": dropped,
                      "processes": procs.world_size, "args": vars(args)})
        self.net = procs.wrap(self.model)  # what training runs; self.model is what is validated and saved

    # ---- persistence --------------------------------------------------------------------
    def log(self, record: dict):
        if not self.procs.is_main:
            return
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def save_state(self):
        """Collective: every process hands its random streams to the main one, which writes."""
        streams = self.procs.gather({name: g.get_rng_state() for name, g in self.generators.items()})
        if not self.procs.is_main:
            return
        self.state_dir.mkdir(exist_ok=True)
        ck.save_weights(self.model.state_dict(), self.state_dir / "model.safetensors")
        ck.save_weights({rng_key(name, rank): state for rank, own in enumerate(streams) for name, state in own.items()},
                        self.state_dir / "rng.safetensors")
        extra = dict(step=self.step, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch, best=self.best,
                     wall=self.wall, snapshots=self.snapshots())
        ck.save_optimizer(self.optimizer, self.state_dir / "optimizer.safetensors", extra)
        if not (self.out / "config.json").exists():
            self.ckpt.save(self.out)
            (self.out / ck.SPM).write_bytes(self.spm_bytes)

    def resume(self):
        self.model.load_state_dict(load_file(str(self.state_dir / "model.safetensors")))
        extra = ck.load_optimizer(self.optimizer, self.state_dir / "optimizer.safetensors")
        streams = load_file(str(self.state_dir / "rng.safetensors"))
        for name, generator in self.generators.items():
            key = rng_key(name, self.procs.rank)
            if key in streams:  # else the saved run had fewer processes: this one keeps its fresh stream
                generator.set_rng_state(streams[key])
        self.step, self.epoch, self.batch_in_epoch = extra["step"], extra["epoch"], extra["batch_in_epoch"]
        self.best, self.wall = extra["best"], extra["wall"]
        if self.procs.is_main:
            print(f"resuming {self.out} at step {self.step}", file=sys.stderr)

    def snapshots(self) -> list[str]:
        return sorted((p.name for p in (self.out / "snapshots").glob("step_*.safetensors")),
                      key=lambda n: int(n[5:-12])) if (self.out / "snapshots").exists() else []

    # ---- evaluation ---------------------------------------------------------------------
    def validate(self, model: Seq2Seq) -> dict:
        model.eval()
        hyps = corpus_translate(model, self.sp, [e.source for e in self.valid], beam=1,
                                max_src_len=self.data_cfg.max_src_len, tags=self.valid_tags)
        refs = [e.refs for e in self.valid]
        if self.data_cfg.task == "translate":
            result = {"bleu": bleu(hyps, refs)}
            result["score"] = result["bleu"]
        else:
            result = rouge(hyps, refs)
            result["score"] = result["rouge1"]
        model.train()
        return result

    def evaluate_and_save(self, train_loss: float):
        """Collective: the main process validates and writes; the others wait for it in save_state."""
        if self.procs.is_main:
            self.evaluate(train_loss)
        self.save_state()

    def evaluate(self, train_loss: float):
        t0 = time.time()
        result = self.validate(self.model)
        snap_dir = self.out / "snapshots"
        snap_dir.mkdir(exist_ok=True)
        ck.save_weights(self.model.state_dict(), snap_dir / f"step_{self.step}.safetensors")
        for old in self.snapshots()[: -self.args.average_last]:
            (snap_dir / old).unlink()
        improved = result["score"] > self.best
        if improved:
            self.best = result["score"]
            self.ckpt.training.update(best_step=self.step, best_valid=result, selected="best")
            self.write_checkpoint(self.model.state_dict())
        self.log({"event": "valid", "step": self.step, "train_loss": train_loss, **result,
                  "best": self.best, "eval_seconds": round(time.time() - t0, 1), "wall": round(self.wall, 1)})

    def write_checkpoint(self, state):
        self.ckpt.training.update(steps=self.step, wall_minutes=round(self.wall / 60, 1),
                                  train_pairs=len(self.batcher.src), processes=self.procs.world_size,
                                  args={k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()})
        ck.save_checkpoint(self.out, self.model, self.ckpt, self.spm_bytes, state=state)

    def average(self):
        names = self.snapshots()[-self.args.average_last:]
        if len(names) < 2:
            return
        averaged = ck.average_weights([self.out / "snapshots" / n for n in names])
        model = Seq2Seq(self.model.cfg).to(self.procs.device)
        model.load_state_dict(averaged)
        result = self.validate(model)
        self.log({"event": "average", "snapshots": names, **result})
        if result["score"] > self.best:
            self.best = result["score"]
            self.ckpt.training.update(best_valid=result, selected=f"average of {names}")
            self.write_checkpoint(averaged)

    # ---- the loop -----------------------------------------------------------------------
    def train_step(self, ids: list[int]) -> tuple[float, int, float]:
        """One optimiser step on the batch `ids`, of which this process computes its share.
        Returns the batch's mean token loss, its target tokens and the gradient norm (unclipped)."""
        args, procs = self.args, self.procs
        batch = self.batcher.collate(self.batcher.shard(ids, procs.rank, procs.world_size)).to(procs.device)
        bow = args.global_bow > 0
        with torch.autocast(procs.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            out = self.net(batch.src, batch.tgt[:, :-1], batch.src_tags, with_global_state=bow)
            logits, word_logits = (out[0], self.model.bag_of_words_logits(out[1])) if bow else (out, None)
        loss_sum, n_tokens = label_smoothed_loss(logits, batch.tgt[:, 1:], args.label_smoothing)
        objective = loss_sum
        if bow:
            objective = objective + args.global_bow * bag_of_words_loss(word_logits, batch.tgt[:, 1:])
        batch_loss, batch_tokens = procs.all_sum(torch.stack([loss_sum.detach(), n_tokens])).tolist()
        self.optimizer.zero_grad(set_to_none=True)
        # DDP averages the processes' gradients; scaled by world_size, that average is their sum:
        # the gradient of the mean token loss over the whole batch, as in a single process.
        (objective * procs.world_size / batch_tokens).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip)
        self.optimizer.step()
        return batch_loss / batch_tokens, int(batch_tokens), float(grad_norm)

    def run(self):
        args, procs = self.args, self.procs
        self.net.train()
        progress = Progress(args.max_steps, args.max_minutes)
        first_step, window_loss, window_norm, window_tokens, window_steps = self.step, 0.0, 0.0, 0, 0
        tick = window_start = time.time()
        while self.step < args.max_steps:
            batches = self.batcher.batches(self.epoch)
            if min(map(len, batches)) < procs.world_size:
                raise SystemExit(f"a batch of {min(map(len, batches))} pairs cannot be split among "
                                 f"{procs.world_size} processes: raise --batch-tokens")
            while self.batch_in_epoch < len(batches) and self.step < args.max_steps:
                ids = batches[self.batch_in_epoch]
                self.batch_in_epoch += 1
                self.step += 1
                lr = args.lr * min(self.step / args.warmup, math.sqrt(args.warmup / self.step))
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                loss, n_tokens, grad_norm = self.train_step(ids)
                window_loss += loss
                window_norm += grad_norm
                window_tokens += n_tokens
                window_steps += 1
                now = time.time()
                self.wall += now - tick
                tick = now
                if self.step % args.log_every == 0:
                    mean_loss = window_loss / window_steps
                    tok_s = window_tokens / max(1e-9, now - window_start)
                    window_start = now
                    if procs.is_main:
                        progress.show(self.step, first_step, mean_loss, tok_s)
                    self.log({"event": "train", "step": self.step, "loss": round(mean_loss, 4), "lr": lr,
                              "grad_norm": round(window_norm / window_steps, 4), "tok_per_s": round(tok_s),
                              "wall": round(self.wall, 1)})
                    window_loss, window_norm, window_tokens, window_steps = 0.0, 0.0, 0, 0
                # every process stops with the main one, whose clock is the run's
                out_of_time = args.max_minutes and procs.from_main(self.wall >= args.max_minutes * 60)
                if self.step % args.eval_every == 0 or self.step >= args.max_steps or out_of_time:
                    self.evaluate_and_save(loss)
                    tick = window_start = time.time()  # validation time is not training time
                elif self.step % args.save_every == 0:
                    self.save_state()
                if out_of_time:
                    args.max_steps = self.step
            if self.batch_in_epoch >= len(batches):
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        if procs.is_main:
            self.average()
        self.save_state()  # the average may have raised the best: a later extension must know it
        # one digest per process: data parallelism must leave every replica identical
        digests = procs.gather(weights_digest(self.model))
        self.log({"event": "done", "step": self.step, "best": self.best, "wall": round(self.wall, 1),
                  "weights_sha256": digests})
        if procs.is_main:
            sys.stderr.write(f"\ndone: step {self.step}, best valid {self.best:.2f}, checkpoint {self.out}\n")


def main(argv=None):
    args = parse_args(argv)
    procs = start(args.device)
    Trainer(args, procs).run()
    procs.close()


if __name__ == "__main__":
    main()
