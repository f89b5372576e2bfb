"""python -m bench report [--publish] [--results DIR] [--out FILE]

Renders the benchmarks' page from the JSON that `python -m bench speed`, `engine`, `server` and
`server --scenario backlog`, `step` and `memory` wrote (bench-speed.json, bench-engine.json, bench-step.json,
bench-server.json, bench-server-backlog.json, bench-memory.json), and `python -m bench gpu` and
`python -m kernels.bench` on a CUDA machine (bench-gpu.json, bench-kernels-DTYPE.json), and embeds their
plots. Every number on the page comes from those files; a benchmark that has not been run is named with its command. By
default runs/bench/BENCHMARKS.md from runs/bench; with --publish docs/BENCHMARKS.md from docs/results.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench import add_publish, pages_dir, results_dir


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(figure: dict | None) -> str:
    """A median ratio with its interquartile range, as the benchmarks store them."""
    if not figure:
        return "—"
    return f"{figure['median']:.2f} ({figure['q1']:.2f}–{figure['q3']:.2f})"


def ms(figure: dict | None) -> str:
    return f"{figure['median']:.0f} ({figure['q1']:.0f}–{figure['q3']:.0f})" if figure else "—"


def cpu(point: dict, server: str) -> str:
    """CPU seconds during a point: the measured server / the other (idle) servers / the load generator."""
    c = point.get("cpu_seconds")
    if not c:
        return ""
    others = sum(v for k, v in c.items() if k not in (server, "bench"))
    if server not in c:  # the offline engine runs inside the benchmark's own process
        return f"{c['bench']:.1f} / {others:.1f} / —"
    return f"{c[server]:.1f} / {others:.1f} / {c['bench']:.1f}"


def provenance(data: dict) -> str:
    m, v = data.get("machine", {}), data.get("versions", {})
    load = lambda key: "/".join(f"{x:.1f}" for x in m.get(key, [])) or "?"
    return (f"Command: `{data['command'].strip()}` · {data.get('date', '?')} · commit {data.get('commit', '?')}  \n"
            f"Machine: {m.get('cpus', '?')} CPUs{', ' + m['cpu'] if m.get('cpu') else ''}, {m.get('platform', '?')}; load average (1/5/15 min) "
            f"{load('load_average_start')} at the start, {load('load_average_end')} at the end"
            f"{' — ' + m['note'] if m.get('note') else ''}  \n"
            f"Versions: {', '.join(f'{k} {x}' for k, x in v.items())}")


def targets_table(targets: dict) -> str:
    rows = []
    for name, t in targets.items():
        if not isinstance(t, dict):
            continue
        bound = f"≤ {t['target']}" if t.get("lower_is_better") else f"≥ {t['target']}"
        rows.append([name, bound, t["measured"], "met" if t["met"] else "**not met**", t.get("note", "")])
    return table(["target", "required", "measured", "", "note"], rows)


def image(results: Path, name: str | None, out: Path, alt: str) -> str:
    if not name or not (results / name).exists():
        return ""
    return f"![{alt}]({Path(os.path.relpath(results / name, out.parent)).as_posix()})"


def split(shares: dict | None) -> str:
    if not shares:
        return "—"
    return " / ".join(f"{100 * shares[k]:.0f}%" for k in ("encode", "decoder", "search", "cache") if k in shares)


def top_k_note(settings: dict) -> str:
    """Which phase a run counted each row's top-k in and how it was chosen: the search's, until the
    decoder step took it over, first as ONNX Runtime's TopK in the graph, then from the graph's
    block maxima on the host."""
    if settings.get("top_k_phase") == "decoder-blocks":
        return ("Each row's top-k candidates are chosen within the decoder step, from the maxima of its "
                "log-probabilities' 64-column blocks (the graph's ReduceMax; the rest on the host, "
                "training.seq2seq.beam.row_top_k).")
    if settings.get("top_k_phase") == "decoder":
        return "Each row's top-k candidates are chosen inside the decoder step (ONNX Runtime's TopK in the graph)."
    return "Each row's top-k candidates are counted under search (ONNX Runtime's TopK, run after the step)."


def engine_section(data: dict, results: Path, out: Path) -> str:
    s = data.get("settings", {})
    parts = [
        "## Offline engine",
        provenance(data),
        (f"{s.get('split', '?')}, {s.get('sentences', '?')} sentences, beam {s.get('beam', '?')}, batches of "
        f"{s.get('batch', '?')}, {s.get('threads', '?')} threads; systems take turns batch by batch. Ratios are "
        "medians over batches with the interquartile range (> 1: faster than the named system)."),
        ("`-2w`: our engine as `--workers 2 --threads 1` runs it; `-2r`: CTranslate2 with 2 replicas "
         "(inter_threads) of 1 thread. The last column splits our engine's busy time: the encoder, the decoder "
         "steps (ONNX Runtime or PyTorch), the beam search between steps (the selection; finished hypotheses) "
         "and, where measured, moving the rows into their next step's state (self-attention cache, encoder "
         "state; earlier runs count it as search). " + top_k_note(s) + " "
         "ONNX Runtime's int8 quantizes each activation matrix with one scale, so a text's int8 output can depend "
         "on the texts that share its batch; fp32 outputs never do."),
    ]
    rows = []
    for name, f in data["systems"].items():
        rows.append([f"`{name}`", f.get("bleu"), f.get("target_tokens_per_s"), f.get("sentences_per_s"),
                     f.get("load_rss_mb"), f.get("decode_rss_mb"), ratio(f.get("speed_vs_ct2-int8")),
                     ratio(f.get("speed_vs_pytorch")),
                     f.get("identical_to_pytorch"), split(f.get("time_split"))])
    parts.append(table(["system", "BLEU", "target tokens/s", "sentences/s", "RSS to load (MB)",
                        "RSS rise decoding (MB)", "× ct2-int8", "× pytorch", "identical to pytorch",
                        "our engine's time: encoder / decoder steps / search / cache"], rows))
    parts.append(targets_table(data.get("targets", {})))
    parts.append(image(results, data.get("plot"), out, "engine speed ratios"))
    return "\n\n".join(p for p in parts if p)


def server_section(data: dict, results: Path, out: Path) -> str:
    s, plan = data["settings"], data["settings"]["plan"]
    engine = data.get("bench_engine")
    parts = [
        "## Server under load",
        provenance(data),
        (f"Model `{s['model']}` ({s['architecture']}, version {s['model_version']}, {s['backend']}), beam {s['beam']}, "
         f"threads per server {s['threads']} (environment {s.get('server_env', {})}), one {s['split']} sentence per "
         "call, over gRPC on loopback. One server per batching policy, all running through the whole benchmark, "
         f"taking turns. Caches: {s.get('caches') or s.get('encoder_cache')}. Target tokens: {s['target_tokens']}."),
        "### Saturation",
        (f"Closed loop, {plan['concurrency']} concurrent callers, {plan['saturation_seconds']} s per point of which "
        f"the first {plan['warmup_seconds']} s are not counted; {plan['rounds']} round(s), each also decoding "
        f"{plan['offline_texts']} of the same texts with the same engine offline (no gRPC, batches of 32): the "
        f"in-run reference. Figures are medians over rounds."),
    ]
    offline = data["offline"]
    rows = [["offline engine (in run)", offline["texts_per_s"], offline["target_tokens_per_s"], "1.00",
             " / ".join(str(r["texts_per_s"]) for r in offline["rounds"]), "",
             " · ".join(cpu(r, "offline") for r in offline["rounds"])]]
    for name, p in data["policies"].items():
        sat = p["saturation"]
        rows.append([f"`{name}`", sat["texts_per_s"], sat["target_tokens_per_s"], sat["vs_offline_in_run"],
                     " / ".join(str(r["texts_per_s"]) for r in sat["rounds"]),
                     " / ".join(str(r["latency_ms"]["p50"]) for r in sat["rounds"] if "latency_ms" in r),
                     " · ".join(cpu(r, name) for r in sat["rounds"])])
    parts.append(table(["", "texts/s", "target tokens/s", "× offline (in run)", "texts/s per round",
                        "p50 latency (ms) per round", "CPU s: measured / idle servers / load generator"], rows))
    if engine:
        e = engine.get("settings") or {}
        parts.append(f"`python -m bench engine` ({engine['file']}, {engine['date']}, {e.get('threads', '?')} threads, "
                     f"batches of {e.get('batch', '?')}) measured `{engine['system']}` at {engine['sentences_per_s']} "
                     "sentences/s in another run under another machine load: saturation ÷ that = "
                     + ", ".join(f"`{n}` {p['saturation']['vs_bench_engine']}" for n, p in data["policies"].items())
                     + ".")
    else:
        parts.append("No `bench-engine.json` of the same checkpoint and threads was there when this "
                     "ran: the comparison is with the in-run offline engine only.")
    parts.append("### Latency against offered load")
    parts.append(f"Open loop: Poisson arrivals at a share of each policy's own saturation throughput for "
                 f"{plan['open_seconds']} s (at most {plan['max_requests']} calls); calls still running "
                 f"{plan['drain_seconds']} s later are cancelled and counted as unfinished. Latency is from the "
                 "scheduled arrival to the answer.")
    for name, p in data["policies"].items():
        rows = []
        for q in p["open_loop"]:
            lat = q.get("latency_ms", {})
            rows.append([q["fraction_of_saturation"], q["offered_per_s"], q["texts_per_s"], q["target_tokens_per_s"],
                         lat.get("p50"), lat.get("p90"), lat.get("p99"),
                         round(lat["p99"] / lat["p50"], 2) if lat else None,
                         q.get("ms_per_token", {}).get("p50"), f"{q['ok']}/{q['calls']}",
                         ", ".join(f"{k} {n}" for k, n in q["errors"].items()) or "none", q["unfinished"],
                         q["load_average"], cpu(q, name)])
        parts.append(f"`{name}`\n\n" + table(
            ["× saturation", "offered/s", "texts/s", "target tokens/s", "p50 ms", "p90 ms", "p99 ms", "p99/p50",
             "ms per token p50", "ok/calls", "errors", "unfinished", "load", "CPU s"], rows))
    parts.append(image(results, data["plots"].get("latency"), out, "latency against throughput per policy"))
    parts.append("### Caches")
    parts.append("An otherwise idle server (continuous batching) per cache: each text sent once (a miss), then at "
                 "once again (a hit); end-to-end latency at the client. The encoder cache skips only the encoder; "
                 "the result cache answers an identical request (same source and options) without decoding. "
                 "Medians over pairs, interquartile range in brackets.")
    rows = [[r.get("cache", "encoder"), f"`{r['options']}`", r["pairs"], ms(r["new_ms"]), ms(r["repeated_ms"]), ratio(r["speedup"]),
             f"{r['hit_flags_as_expected']}/{r['pairs']}", r["output_tokens_median"]]
            for r in data["cache"].values()]
    parts.append(table(["cache hit", "request options", "pairs", "new source (ms)", "repeated source (ms)", "speed-up",
                        "cache flags as expected", "output tokens (median)"], rows))
    parts.append(image(results, data["plots"].get("cache"), out, "caches: new vs repeated source"))
    parts.append("### Targets")
    parts.append("Judged on the default policy (continuous batching); the other policies are in the tables above.")
    parts.append(targets_table(data["targets"]))
    return "\n\n".join(p for p in parts if p)


def backlog_section(data: dict, results: Path, out: Path) -> str:
    s, plan = data["settings"], data["settings"]["plan"]
    summary, rounds = [], []
    for name, m in data["servers"].items():
        a = m["all_rounds"]
        summary.append([f"`{name}`", f"`{' '.join(shown_flags(m['server_flags']))}`", m["idle"]["latency_ms"]["p50"],
                        a["calls"], a["latency_ms"]["p50"], a["latency_ms"]["p90"], a["latency_ms"]["p99"],
                        a["latency_ms"]["max"], a["backlog_texts_per_s_median"]])
        for i, r in enumerate(m["rounds"]):
            lat = r["latency_ms"]
            rounds.append([i + 1, f"`{name}`", r["backlog_texts"], r["backlog_seconds"], r["backlog_texts_per_s"],
                           r["queued_at_first_call"], f"{r['ok']}/{r['calls']}", lat["p50"], lat["p99"], lat["max"],
                           ", ".join(f"{k} {n}" for k, n in r["errors"].items()) or "none",
                           "/".join(f"{x:.1f}" for x in r["load_average"])])
    rounds.sort(key=lambda row: row[0])
    parts = [
        "## One-text calls behind a backlog",
        provenance(data),
        (f"`python -m server` with its default flags (the model and the ports named, nothing else), `{s['model']}` "
         f"({s['architecture']}, {s['backend']}), options {s['options']}; beside it, servers with other flags, the "
         f"servers taking turns round by round. Each round sends {plan['streams']} TranslateStream calls of "
         f"{plan['texts_per_stream']} texts at once (a {plan['streams'] * plan['texts_per_stream']}-text backlog), "
         f"then a one-text Translate call every {plan['probe_interval_s']} s until the backlog is answered; counted "
         "are the one-text calls sent before then, latency from sending to the answer. Idle: the same calls one at a "
         f"time before any backlog. {s['texts']}, so neither cache answers. Backlog texts/s: the backlog's texts over "
         "the time from sending it to its last answer (the server at saturation)."),
        table(["server", "flags", "idle p50 ms", "one-text calls", "p50 ms", "p90 ms", "p99 ms", "max ms",
               "backlog texts/s (median round)"], summary),
        ("Per round. Queued: the texts waiting for admission (the server's queue-depth metric) when the first "
         "one-text call went out. Load: the machine's load average (1/5/15 min) after the round."),
        table(["round", "server", "backlog texts", "backlog s", "backlog texts/s", "queued", "one-text calls ok",
               "p50 ms", "p99 ms", "max ms", "errors", "load"], rounds),
        targets_table(data["targets"]),
    ]
    return "\n\n".join(p for p in parts if p)


def memory_section(data: dict, results: Path, out: Path) -> str:
    settings = data["settings"]
    phases = ["loaded", "caches", "steady", "extreme", "spike", "after"]
    rows = []
    for name, m in settings.items():
        peaks, load = m["peaks"], m["load"]["phases"]
        steady = load.get("steady", {})
        rows.append([f"`{name}`", f"`{' '.join(shown_flags(m['flags']))}`",
                     m["processes_at_peak"],
                     *[peaks[p]["pss_mib"] if p in peaks else "—" for p in phases],
                     m["peak_pss_mib"], m["peak_rss_mib"],
                     steady.get("texts_per_s", "—"), steady.get("latency_ms", {}).get("p50", "—")])
    plan = next(iter(settings.values()))["load"]["plan"]
    parts = [
        "## Memory under load",
        provenance(data),
        ("`python -m server` serving every shipped model, the server process and the processes it started together, "
         f"sampled every 0.2 s. Phases, all models at once: caches (distinct cheap texts until every encoder cache "
         f"has evicted, at most {plan['caches']['texts']} texts per model), steady ({plan['steady']['callers']} "
         f"callers in a closed loop for {plan['steady']['seconds']} s, one text per call, default options), extreme "
         f"(for {plan['extreme']['seconds']} s, per model {plan['extreme']['callers']} callers with the largest valid "
         "options: beam and n-best at the maximum, every output as long as the model allows, scores; beside as many "
         f"with 256 short greedy texts each), spike ({plan['spike']['calls']} one-text calls at once). PSS: "
         "proportional set size, each shared page divided among the processes that map it, so the sum counts it "
         "once: what a cgroup's memory limit charges for them. RSS counts a shared page (libraries, the read-only "
         f"model files) in every process: an upper bound. The pod's limit: {data['pod_limit']['memory']}."),
        table(["setting", "flags", "processes", *[f"PSS MiB {p}" for p in phases], "peak PSS MiB", "peak RSS MiB",
               "steady texts/s", "steady p50 ms"], rows),
        targets_table(data["targets"]) if data.get("targets") else "",
    ]
    return "\n\n".join(p for p in parts if p)


def shown_flags(flags: list[str]) -> list[str]:
    """A server's flags without those that only say where it listens or builds (ports, build cache)."""
    hidden = ("--metrics-port", "--http-port", "--port", "--build-cache")
    shown, skip = [], False
    for a in flags:
        if skip:
            skip = False
        elif a in hidden:
            skip = True
        elif not a.startswith(tuple(h + "=" for h in hidden)):
            shown.append(a)
    return shown


def speed_section(data: dict, results: Path, out: Path) -> str:
    s, med = data["settings"], data["medians"]
    names = [n for n in data["rounds"][0] if n != "ratios"]
    rows = [[f"`{n}`", data["texts_per_s"][n], " / ".join(f"{r[n]['texts_per_s']:.1f}" for r in data["rounds"]),
             " / ".join(f"{r[n]['latency_ms']['p50']:.0f}" for r in data["rounds"]) if "latency_ms" in data["rounds"][0][n]
             else ""] for n in names]
    sweep = data["sweep"]
    callers = sorted(sweep["server"], key=int)
    sweep_rows = [[c, sweep["server"][c]["texts_per_s"], sweep["ct2"][c]["texts_per_s"],
                   sweep["server"][c]["latency_ms"]["p50"], sweep["ct2"][c]["latency_ms"]["p50"]] for c in callers]
    memory = "; ".join(f"`{name}` {m['total']} MB in {len(m['processes'])} process(es)"
                       for name, m in data["resident_mb"].items())
    parts = [
        "## The server with its defaults against CTranslate2",
        provenance(data),
        (f"`python -m server` with its default flags (both caches off, since the texts repeat), {s['callers']} callers "
         f"in a closed loop over gRPC on loopback, one Multi30K test_2016_flickr sentence per call, beam {s['beam']}; "
         f"`{s['model']}` and the GRET model `{s['gret']}` each on their own server. CTranslate2 int8 offline on the "
         f"same weights and texts (the first {s['texts']} sentences of the test set: the callers cycle through them, "
         f"each offline round decodes each of them once), batches of {s['ct2_batch']}, as 1 replica × {data['cores']} threads and "
         f"{data['cores']} replicas × 1 thread. {s['rounds']} rounds, the systems taking turns; ratios are medians of "
         f"the per-round ratios (the server over the better CTranslate2 setting of that round)."
         + (" `server-ct2` is the vanilla server with `--backend ct2`: CTranslate2's own engine and replicas behind "
            "our gRPC service, so `server_ct2_vs_ct2` is what the service around an engine costs, whatever the engine."
            if "server_ct2_vs_ct2" in med else "")
         + "".join(f" `server-vanilla {flags}` is the vanilla server with `{flags}` on top of its defaults, in "
                   f"the same rounds (its ratio: `server_vs_ct2` followed by its flags)."
                   for flags in s.get("compare", []))),
        table(["system", "texts/s (median)", "texts/s per round", "p50 ms per round"], rows),
        table(["ratio", "median", "per round"],
              [[k, med[k], " / ".join(str(r["ratios"][k]) for r in data["rounds"])] for k in med]),
        engine_note(data, s),
        f"Resident memory at the end: {memory}.",
        cpu_split(data),
        "### Throughput against callers",
        ("Closed loop; CTranslate2 answers each caller's one sentence itself (replicas = cores, one thread each), "
         "so it batches nothing across callers. One caller's p50 is the single-user latency."),
        table(["callers", "server texts/s", "CTranslate2 texts/s", "server p50 ms", "CTranslate2 p50 ms"], sweep_rows),
        image(results, "bench-speed.png", out, "texts/s against callers"),
        targets_table(data["targets"]),
    ]
    return "\n\n".join(p for p in parts if p)


def engine_note(data: dict, settings: dict) -> str:
    """What the offline engine is, and where its busy time goes."""
    rounds = data["rounds"]
    if "engine-offline" not in rounds[0]:
        return ""
    note = (f"`engine-offline`: the server's engine without gRPC ({data['engine_setting']}), every "
            f"text of the round submitted at once. Its busy time by phase (median round): "
            + " / ".join(f"{k} {100 * statistics.median(r['engine-offline']['busy_share'][k] for r in rounds):.0f}%"
                         for k in rounds[0]["engine-offline"]["busy_share"]) + ". ")
    return note + top_k_note(settings)


def cpu_split(data: dict) -> str:
    """Where a served text's time goes, from each server round's own readings (bench.speed.usage)."""
    first = data["rounds"][0]
    servers = [n for n in first if n.startswith("server-") and "ms_per_text" in first[n]]
    if not servers:
        return ""
    ct2 = statistics.median(data["cores"] / r[r["ratios"]["ct2_best"]]["texts_per_s"] * 1e3 for r in data["rounds"])
    keys = list(first[servers[0]]["ms_per_text"])
    rows, cpu, workers = [], {}, {}
    for n in servers + (["grpc-floor"] if "grpc-floor" in first else []):
        med = {k: statistics.median(r[n]["ms_per_text"][k] for r in data["rounds"]) for k in keys
               if k in first[n]["ms_per_text"]}
        cpu[n] = med["client"] + med["server parent"] + med.get("workers", 0)
        workers[n] = med.get("workers")
        rows.append([f"`{n}`", *(f"{med[k]:.2f}" if k in med else "—" for k in keys), f"{cpu[n]:.2f}",
                     f"{cpu[n] / ct2:.2f}"])
    return "\n\n".join([
        "### Where a served text's time goes",
        ("Milliseconds per answered text over each server round of the score (median of the rounds). CPU time: "
         "`client` is the load generator, `server parent` the server's gRPC process (gRPC, the text pipeline, "
         "dispatch to the workers; with `--backend ct2` also CTranslate2's decoding, which runs in it), `workers` its "
         "engine worker processes (from the server's own metrics). "
         "`encode` … `cache` split the workers' engine loops by phase, in their thread's wall time. CTranslate2 "
         f"offline, its best setting of each round, takes {ct2:.2f} core-ms per text (cores ÷ texts/s); "
         "`÷ CTranslate2` is the served text's CPU over that."
         + (" `grpc-floor` is the same load on a gRPC service with no model behind it (bench.grpc_floor), per "
            "call: what gRPC alone costs the client and the service, a floor that no Python gRPC service goes "
            "below (its texts/s above are calls answered after a pause, not a speed)." if "grpc-floor" in first else "")),
        table(["system", *keys, "CPU in all", "÷ CTranslate2"], rows),
        ceiling(data, ct2, cpu.get("grpc-floor"), workers.get("server-vanilla"))])


def ceiling(data: dict, ct2_ms: float, floor: float | None, served: float | None = None) -> str:
    """The best server ÷ CTranslate2 a gRPC service around our engine could reach on this machine: a
    served text costs at least what the engine costs per text plus gRPC's floor (`floor`: the
    client's and the service's CPU per call, as cpu_split's table gives it), and the cores are
    CPU-bound at 64 callers. The engine's cost is the cheaper of two readings: the offline engine's
    core-ms (cores ÷ its texts/s; it decodes the whole round at once, in larger batches than the
    callers make, which cost more per row past a hundred or so) and `served`, the vanilla server's
    workers' CPU per text."""
    rounds = data["rounds"]
    if floor is None or "engine-offline" not in rounds[0]:
        return ""
    offline = statistics.median(data["cores"] / r["engine-offline"]["texts_per_s"] * 1e3 for r in rounds)
    engine = min(offline, served) if served else offline
    reading = (f"the offline engine costs {offline:.2f} core-ms per text" if engine == offline else
               f"the engine costs {engine:.2f} core-ms per text as the server's workers run it (the offline "
               f"engine, in its larger batches, {offline:.2f})")
    result = data["medians"]["server_vs_ct2"]
    bound = ct2_ms / (engine + floor)
    needed = ct2_ms - floor  # the engine's CPU per text at which the bound is 1.0
    margin = (f"{engine / needed:.2f}× faster than this one" if engine >= needed else
              f"which this one is {needed / engine:.2f}× below")
    return (f"The bound on this machine: {reading} and gRPC's floor {floor:.2f} ms per call (client and service), "
            f"so a server adding nothing else would cost {engine + floor:.2f} core-ms per text against "
            f"CTranslate2's {ct2_ms:.2f}, a ratio of {bound:.2f} at best, with the client on the same cores. The "
            f"server's {result} is {result / bound:.0%} of that bound; 1.0 needs an engine of at most "
            f"{needed:.2f} core-ms per text, {margin}.")


def step_section(data: dict, results: Path, out: Path) -> str:
    s = data["settings"]
    graph = data["graph"]
    base = graph.get("vanilla", {})
    rows = []
    for name, by_precision in graph.items():
        for precision, f in by_precision.items():
            at = dict(zip(f["rows"], f["ms"]))
            vs = base.get(precision, {}).get("per_row_us")
            rows.append([f"`{name}`", precision, f["fixed_ms"], f["per_row_us"],
                         f"{f['per_row_us'] / vs:.2f}" if vs else "—"] + [at[r] for r in f["rows"]])
    counts = next(iter(next(iter(graph.values())).values()))["rows"]
    engine_rows = []
    for name, f in data["engine"].items():
        for p in f["points"]:
            engine_rows.append([f"`{name}`", p["in_flight"], p["rows"], p["texts_per_s"]]
                               + [p["ms"][k] for k in ("encode", "decoder", "search", "cache")]
                               + [round(sum(p["ms"].values()), 3)])
        fit = f["fit"]
        engine_rows.append([f"`{name}` line", "", "", ""] + [f"{fit[k]['fixed_ms']} + {fit[k]['per_row_us']} µs"
                                                              for k in ("encode", "decoder", "search", "cache", "step")])
    return "\n\n".join(p for p in [
        "## One step: fixed overhead and cost per row",
        provenance(data),
        (f"The decoder step alone (ONNX Runtime through the backend's binding, one thread), for R rows: beam "
         f"{s['beam']} rows per sentence, a {s['source']}-piece source, a self-attention cache {s['width']} columns "
         f"wide with each row at a random position in it; untrained models of each architecture at the `{s['preset']}` size with {s['vocab']} pieces (a step's "
         f"time depends on shapes, not weights). Median of {s['reps']} steps per point; the architectures take "
         "turns at each row count. `fixed` and `per row` are the intercept and slope of a line through the points, "
         "fitted to their relative errors (a step's timing noise grows with its time); `per row ÷ vanilla` "
         "compares an architecture's cost per row with vanilla's."),
        table(["architecture", "precision", "fixed ms", "per row µs", "per row ÷ vanilla"]
              + [f"ms at {r}" for r in counts], rows),
        ("The engine loop (the server's admission defaults, int8, one thread) on trained models, with N texts in "
         "flight: a closed loop over test_2016_flickr in which a finished text is replaced at once. Milliseconds "
         "per step by phase, mean rows per step; the `line` rows fit each phase against the rows (fixed ms + µs per row)."),
        table(["model", "in flight", "rows/step", "texts/s", "encode ms", "decoder ms", "search ms", "cache ms",
               "step ms"], engine_rows),
        " ".join(f"`{name}`: at its widest point ({f['points'][-1]['rows']} rows) the fixed part is "
                 f"{100 * f['fit']['step']['fixed_ms'] / sum(f['points'][-1]['ms'].values()):.0f}% of a step, and of "
                 f"the cost per row the decoder graph takes "
                 f"{100 * f['fit']['decoder']['per_row_us'] / f['fit']['step']['per_row_us']:.0f}%."
                 for name, f in data["engine"].items()),
        image(results, data.get("plot"), out, "ms per step against rows"),
        cold_paragraph(graph, s),
        *ops_parts(data.get("ops")),
    ] if p)


def cold_paragraph(graph: dict, settings: dict) -> str:
    """The vanilla int8 step with its memory cold (bench.step's EVICT_BYTES written before each)."""
    f = graph.get("vanilla", {}).get("int8", {})
    if "cold_ms" not in f:
        return ""
    pairs = ", ".join(f"{r}: {w} → {c}" for r, w, c in zip(f["rows"], f["ms"], f["cold_ms"]))
    return (f"The same `vanilla` int8 step with its memory cold ({settings['evict_mb']} MB written before each "
            "step, as the rest of a "
            f"served step evicts what the step read last time), ms at each row count, warm → cold: {pairs}.")


def ops_parts(ops: dict | None) -> list[str]:
    """The engine loop's graphs by operator type (bench.step's ops part): ms per text."""
    if not ops:
        return []
    columns = [(name, g) for name, f in ops.items() for g in f["ms_per_text"]]
    totals = {(name, g): sum(ops[name]["ms_per_text"][g].values()) for name, g in columns}
    ranked = sorted({op for name, g in columns for op in ops[name]["ms_per_text"][g]},
                    key=lambda op: -sum(ops[name]["ms_per_text"][g].get(op, 0) for name, g in columns))
    shown = ranked[:12]
    rows = [[f"`{op}`"] + [round(ops[name]["ms_per_text"][g].get(op, 0), 3) for name, g in columns] for op in shown]
    rows.append(["other"] + [round(totals[c] - sum(ops[c[0]]["ms_per_text"][c[1]].get(op, 0) for op in shown), 3)
                             for c in columns])
    rows.append(["**all**"] + [round(totals[c], 3) for c in columns])
    first = next(iter(ops.values()))
    return [("Where the graphs' time goes in the loaded engine loop: the closed loop again at "
             f"{first['in_flight']} texts in flight ({first['texts']} texts), with ONNX Runtime's profiler on the "
             "encoder and decoder sessions; each operator type's kernel time in ms per text (the sessions' own "
             "fused operators: `DynamicQuantizeMatMul` and `MatMulIntegerToFloat` are the int8 projections, "
             "`GroupQueryAttention` the self-attention over the cache; `FusedMatMul` and `MatMul` are mostly the "
             "decoder's cross-attention and, in a GRET encoder, its capsule routing). The profiler adds its own "
             "cost to each node it times, so a small operator reads larger here than it runs: time it alone, on the "
             "same shapes, before choosing what to optimise."),
            table(["operator"] + [f"`{name}` {g}" for name, g in columns], rows)]


def gpu_section(data: dict, results: Path, out: Path) -> str:
    """`python -m bench gpu`: the engine on a CUDA device against the same engine on the CPU."""
    counts = [p["in_flight"] for p in next(iter(data["models"].values()))["gpu"]]
    rows = [[f"`{name}`", f"{m['identical_outputs']}/{m['texts']}", m["cpu"]["texts_per_s"],
             *[p["texts_per_s"] for p in m["gpu"]], m["gpu_over_cpu_at_64"]]
            for name, m in data["models"].items()]
    s = data["settings"]
    return "\n\n".join([
        "## The engine on a GPU",
        provenance(data) + f"  \nDevice: {data['device']}",
        (f"`python -m server --backend torch --device cuda`'s engine in this process (PyTorch backend, "
         f"{s['precision']}, beam {s['beam']}; on the GPU the Triton kernels), {s['split']}, against the same engine "
         f"on this machine's CPU ({s['cpu_threads']} torch threads, the server's default admission budget). Identical "
         f"outputs: the texts whose best hypothesis on the GPU is the CPU engine's, both at {s['compared_in_flight']} "
         "texts in flight. Speed: texts/s in closed loops of N texts in flight."),
        table(["model", "identical outputs", f"CPU at {s['compared_in_flight']}"]
              + [f"GPU at {n}" for n in counts] + [f"GPU ÷ CPU at {s['compared_in_flight']}"], rows)])


def kernels_section(runs: list[dict]) -> str:
    """`python -m kernels.bench` on a CUDA machine, one run per dtype."""
    parts = ["## Triton kernels on a GPU",
             ("Each kernel against its PyTorch reference on the same tensors (`triton.testing.do_bench`, ms), then "
              "the whole model's beam search (random-init `small` preset, GRET + GCA, so every kernel runs) on its "
              "Triton path against its reference path, alternated in one run, with how many outputs agree. The "
              "model runs in fp32 in every run; the dtype is the kernels' alone. One run each: a kernel that takes "
              "tens of microseconds is mostly launch overhead, and its ratio moves from run to run.")]
    for data in runs:
        rows = [[k["kernel"], " ".join(f"{a}={b}" for a, b in k["shape"].items()), f"{k['reference_ms']:.3f}",
                 "—" if k["triton_ms"] is None else f"{k['triton_ms']:.3f}",
                 "—" if k["triton_ms"] is None else f"{k['reference_over_triton']:.2f}"] for k in data["kernels"]]
        model = [[m["batch"], m["beam"], f"{m['reference_ms']:.1f}", f"{m['triton_ms']:.1f}",
                  f"{m['reference_over_triton']:.2f}", m["same_outputs"]] for m in data.get("model", [])]
        parts += [f"### {data['kernels'][0]['dtype']} on {data['device']}",
                  f"Command: `{data['command']}` · {data['date']} · torch {data['torch']}, triton {data['triton']}",
                  table(["kernel", "shape", "reference ms", "Triton ms", "reference ÷ Triton"], rows)]
        if model:
            parts.append(table(["sentences", "beam", "reference ms", "Triton ms", "reference ÷ Triton",
                                "same outputs"], model))
    return "\n\n".join(parts)


def render(results: Path, out: Path) -> str:
    parts = ["# Benchmarks",
             (f"Generated by `python -m bench report` from `{results.name}/bench-*.json`; no number here is typed "
             "by hand. Each section names the command that measured it. The machine is shared with other work, "
             "so absolute times move between runs: read the ratios and the side-by-side comparisons.")]
    for name, section, command in (("bench-speed.json", speed_section, "python -m bench speed"),
                                   ("bench-engine.json", engine_section, "python -m bench engine"),
                                   ("bench-step.json", step_section, "python -m bench step"),
                                   ("bench-server.json", server_section, "python -m bench server"),
                                   ("bench-server-backlog.json", backlog_section,
                                    "python -m bench server --scenario backlog"),
                                   ("bench-memory.json", memory_section, "python -m bench memory"),
                                   ("bench-gpu.json", gpu_section, "python -m bench gpu --publish on a CUDA machine")):
        path = results / name
        if path.exists():
            parts.append(section(json.loads(path.read_text()), results, out))
        else:
            parts.append(f"`{name}` is not there yet: run `{command}`.")
    kernel_runs = sorted(results.glob("bench-kernels-*.json"), key=lambda p: ("float32" not in p.name, p.name))
    parts.append(kernels_section([json.loads(p.read_text()) for p in kernel_runs]) if kernel_runs else
                 "`bench-kernels-DTYPE.json` is not there yet: on a CUDA machine run "
                 "`python -m kernels.bench --dtype DTYPE --out bench-kernels-DTYPE.json`.")
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, help="folder with bench-engine.json, bench-server.json")
    p.add_argument("--out", type=Path, help="default: BENCHMARKS.md in runs/bench (docs/ with --publish)")
    add_publish(p)
    args = p.parse_args(argv)
    args.results = args.results or results_dir(args.publish)
    args.out = args.out or pages_dir(args.publish) / "BENCHMARKS.md"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(args.results.resolve(), args.out.resolve()))
    print(f"wrote {args.out}")
    return 0
