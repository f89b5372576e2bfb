"""The set of served models: loading them from the configuration, and finding the one a request
means (by name, by language pair, or the default for a task)."""
from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from .catalog import ModelError, discover, load_entry
from .config import ServerConfig
from .languages import AUTO, detect, normalize
from .metrics import Metrics
from .pipeline import Pipeline, build_pipeline, verify_build

log = logging.getLogger("server.registry")


DETECT_CHARS = 2000  # enough to tell a language; more only costs time


class ModelNotFound(LookupError):
    pass


class Registry:
    def __init__(self, pipelines: list[Pipeline]):
        self.pipelines = {p.entry.name: p for p in pipelines}

    @classmethod
    def load(cls, config: ServerConfig, metrics: Metrics | None = None) -> "Registry":
        """Every configured model, or ModelError naming the first that fails (with
        skip_bad_models, bad ones are logged and skipped, as long as one model loads)."""
        folders = discover(Path(config.models_dir), config.models or None)
        build_cache = Path(config.build_cache) if config.build_cache else None
        verify = partial(verify_build, threads=config.threads) if config.verify_build else None
        pipelines, failures = [], []
        # One budget bounds the whole process's encoder caches: each model gets its share.
        cache_bytes = (config.cache_mb << 20) // max(1, len(folders))
        for folder in folders:
            try:
                entry = load_entry(folder, config.backend, build_cache, verify)
                pipeline = build_pipeline(
                    entry, config.backend, config.precision, config.threads, config.batching,
                    config.max_batch_tokens, config.max_queue, cache_bytes, config.limits(),
                    metrics.observer(entry.name) if metrics else None, config.loops(), config.result_cache,
                    config.replica_kind(), config.max_call_share, config.device, config.max_bulk_share)
            except Exception as e:  # whatever breaks loading (safetensors, ONNX Runtime, ...) is this folder's problem
                problem = str(e) if isinstance(e, ModelError) else f"{folder}: {type(e).__name__}: {e}"
                if not config.skip_bad_models:
                    raise ModelError(problem) from e
                log.error("skipping model folder %s: %s", folder, problem)
                failures.append(folder)
                continue
            pipelines.append(pipeline)
            log.info("loaded model %s (version %s, %s %s->%s, %s, backend %s %s, %d %s replicas x %d threads)",
                     entry.name, entry.version, entry.task, entry.source_language, entry.target_language,
                     entry.architecture, config.backend, pipeline.precision, config.loops(), config.replica_kind(),
                     config.threads)
            if metrics:
                metrics.add_model(pipeline)
        if not pipelines:
            raise ModelError(f"no model could be loaded from {config.models_dir}")
        return cls(pipelines)

    # ---- lookup ---------------------------------------------------------------------------------
    def find(self, task: str, name: str = "", source: str = "", target: str = "") -> Pipeline:
        """By name, else by language pair (codes in any form server.languages reads), else the task's default."""
        source, target = normalize(source), normalize(target)
        if name:
            pipeline = self.pipelines.get(name)
            if pipeline is None:
                raise ModelNotFound(f"no model named {name!r}; loaded: {', '.join(sorted(self.pipelines))}")
            if pipeline.entry.task != task:
                raise ModelNotFound(f"model {name!r} does not {task} (it is a {pipeline.entry.task} model)")
            return pipeline
        candidates = [p for p in self.pipelines.values() if p.entry.task == task
                      and (not source or p.entry.source_language == source)
                      and (not target or p.entry.target_language == target)]
        if not candidates:
            available = sorted(f"{p.entry.source_language}->{p.entry.target_language}"
                               for p in self.pipelines.values() if p.entry.task == task)
            wanted = f" {source or '*'}->{target or '*'}" if source or target else ""
            raise ModelNotFound(f"no {task} model{wanted}; available: {', '.join(available) or 'none'}")
        return min(candidates, key=lambda p: p.entry.name)  # deterministic: the first by name

    def detect_source(self, texts: list[str], target: str = "") -> str:
        """The language of `texts` among the sources of the translation models into `target`
        (server.languages.detect), or "auto" when none can be told: no model is then found."""
        target = normalize(target)
        sources = {p.entry.source_language for p in self
                   if p.entry.task == "translate" and (not target or p.entry.target_language == target)}
        return detect("\n".join(texts)[:DETECT_CHARS], sources) or AUTO

    def is_default(self, pipeline: Pipeline) -> bool:
        e = pipeline.entry
        return self.find(e.task, source=e.source_language, target=e.target_language) is pipeline

    def __iter__(self):
        return iter(self.pipelines.values())

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        for p in self:
            p.engine.start()

    def drain(self) -> None:
        for p in self:
            p.engine.drain()

    def idle(self) -> bool:
        return all(p.engine.idle() for p in self)

    def stop(self, timeout: float = 5.0) -> None:
        for p in self:
            p.engine.stop(timeout)
