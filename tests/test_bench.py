"""`python -m bench server --quick` (the CI smoke run; also its backlog scenario) against tiny models
trained in the test run, then `python -m bench report` from what it wrote: it runs and its output is sane. No speed is
asserted; the machine the tests run on decides those."""
from __future__ import annotations

import json

import pytest
import torch

from bench.__main__ import main as bench_main
from bench.memory import pod_flags
from bench.provenance import Run

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_benchmark_record_opens_with_where_its_numbers_come_from():
    header = Run("bench speed", ["--quick", "--note", "training paused"], "training paused").header()
    assert header["command"] == "python -m bench speed --quick --note 'training paused'"  # shell-quoted: it reruns
    assert header["commit"] and header["date"].endswith(" UTC")
    assert {"python", "torch", "onnxruntime", "ctranslate2", "grpcio"} <= set(header["versions"])
    machine = header["machine"]
    assert machine["cpus"] >= machine["usable_cpus"] >= 1 and machine["note"] == "training paused"
    assert len(machine["load_average_start"]) == len(machine["load_average_end"]) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_the_gpu_benchmark_says_it_needs_a_gpu_where_there_is_none(capsys):
    assert bench_main(["gpu", "--quick"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_the_report_names_the_gpu_benchmark_until_a_run_is_there_then_renders_its_table(tmp_path):
    """A GPU run's JSON in bench gpu's shape (its numbers made up here: this machine has no GPU)."""
    results, page = tmp_path / "results", tmp_path / "BENCHMARKS.md"
    results.mkdir()
    assert bench_main(["report", "--results", str(results), "--out", str(page)]) == 0
    assert "`bench-gpu.json` is not there yet: run `python -m bench gpu --publish on a CUDA machine`" in page.read_text()
    point = lambda n, rate: {"in_flight": n, "steps": 10, "rows": 4.0, "texts_per_s": rate, "ms": {}}  # noqa: E731
    run = {**Run("bench gpu", ["--publish"]).header(), "device": "a GPU",
           "settings": {"beam": 4, "precision": "fp32", "backend": "torch", "cpu_threads": 16, "compared_in_flight": 64,
                        "gpu_budget": 1 << 22, "cpu_budget": 8192, "split": "multi30k test_2016_flickr"},
           "models": {"m": {"texts": 1000, "identical_outputs": 998, "cpu": point(64, 50.0),
                            "gpu": [point(1, 20.0), point(64, 400.0)], "gpu_over_cpu_at_64": 8.0}}}
    (results / "bench-gpu.json").write_text(json.dumps(run))
    assert bench_main(["report", "--results", str(results), "--out", str(page)]) == 0
    text = page.read_text()
    assert "## The engine on a GPU" in text and "Device: a GPU" in text and "`python -m bench gpu --publish`" in text
    assert "| `m` | 998/1000 | 50.0 | 20.0 | 400.0 | 8.0 |" in text


def test_the_speed_report_bounds_the_served_ratio_by_the_engine_plus_grpcs_floor():
    """A server costs at least the offline engine's core-ms per text plus gRPC's per-call floor: with 2 cores,
    CTranslate2 at 200 texts/s (10 core-ms), the engine at 250 (8) and a floor of 0.5 + 1.5 ms, the best
    ratio is 10 / (8 + 2) = 1.00; the server's 0.8 is 80% of it, and 1.0 needs an engine of 8 core-ms (served
    workers at 7 are below it)."""
    from bench.report import ceiling

    data = {"rounds": [{"ct2-int8-2x1": {"texts_per_s": 200.0}, "engine-offline": {"texts_per_s": 250.0}}],
            "cores": 2, "medians": {"server_vs_ct2": 0.8}}
    text = ceiling(data, 10.0, 0.5 + 1.5)
    assert "a ratio of 1.00 at best" in text and "The server's 0.8 is 80% of that bound" in text
    assert "an engine of at most 8.00 core-ms per text, 1.00× faster than this one" in text
    assert ceiling(data, 10.0, None) == ""  # a run without the gRPC floor has no bound
    # served workers cheaper than the offline engine (its batches are larger): the bound takes theirs, 7 + 2
    text = ceiling(data, 10.0, 0.5 + 1.5, served=7.0)
    assert "the engine costs 7.00 core-ms per text as the server's workers run it" in text
    assert "a ratio of 1.11 at best" in text and "1.0 needs an engine of at most 8.00 core-ms" in text
    assert "8.00 core-ms per text, which this one is 1.14× below" in text  # already there
    assert ceiling(data, 10.0, 0.5 + 1.5, served=9.0) == ceiling(data, 10.0, 0.5 + 1.5)  # the offline engine is cheaper


def test_quick_server_benchmark_writes_sane_results_and_the_report_renders_them(served_models, tmp_path):
    results = tmp_path / "results"
    code = bench_main(["server", "--quick", "--models-dir", str(served_models), "--model", "tiny-de-en",
                       "--threads", "1", "--build-cache", str(tmp_path / "build"), "--out-dir", str(results),
                       "--engine-results", str(tmp_path / "no-engine-results.json")])
    assert code == 0
    result = json.loads((results / "bench-server.json").read_text())

    assert result["commit"] and result["settings"]["model"] == "tiny-de-en" and result["settings"]["threads"] == 1
    assert {"grpcio", "onnxruntime", "torch"} <= set(result["versions"])
    assert result["machine"]["cpus"] >= 1 and len(result["machine"]["load_average_end"]) == 3
    assert result["offline"]["texts_per_s"] > 0 and result["bench_engine"] is None
    assert all(0 < r["encoder_share"] < 1 for r in result["offline"]["rounds"])  # what bounds an encoder-cache hit
    assert set(result["policies"]) == {"continuous", "request", "none"}
    for policy in result["policies"].values():
        saturation = policy["saturation"]
        assert saturation["texts_per_s"] > 0 and saturation["target_tokens_per_s"] > 0
        assert saturation["vs_offline_in_run"] > 0
        for point in policy["open_loop"]:
            assert point["mode"] == "open" and point["offered_per_s"] > 0 and point["ok"] > 0
            assert point["texts_per_s"] > 0 and point["target_tokens_per_s"] > 0
            assert 0 < point["latency_ms"]["p50"] <= point["latency_ms"]["p99"]
            assert point["errors"] == {} and point["unfinished"] == 0
    for cache in result["cache"].values():  # the server must report a miss, then a hit, for each pair
        assert cache["pairs"] > 0 and cache["hit_flags_as_expected"] == cache["pairs"]
    assert {"saturation_vs_offline_in_run", "p99_over_p50_at_half_load", "cache_speedup_beam"} <= set(result["targets"])
    for name in result["plots"].values():
        assert (results / name).read_bytes().startswith(PNG)

    page = tmp_path / "BENCHMARKS.md"
    assert bench_main(["report", "--results", str(results), "--out", str(page)]) == 0
    text = page.read_text()
    assert "## Server under load" in text and "`python -m bench server --quick" in text
    assert "](results/bench-server-latency.png)" in text and "bench-engine.json` is not there yet" in text


def test_quick_backlog_scenario_times_one_text_calls_behind_a_backlog_and_the_report_renders_it(served_models,
                                                                                                   tmp_path):
    results = tmp_path / "results"
    code = bench_main(["server", "--scenario", "backlog", "--quick", "--models-dir", str(served_models),
                       "--model", "tiny-de-en", "--build-cache", str(tmp_path / "build"), "--out-dir", str(results),
                       "--compare", "--max-call-share 1"])
    assert code == 0
    result = json.loads((results / "bench-server-backlog.json").read_text())
    assert result["settings"]["model"] == "tiny-de-en" and len(result["machine"]["load_average_end"]) == 3
    plan = result["settings"]["plan"]
    assert set(result["servers"]) == {"defaults", "--max-call-share 1"}
    assert result["servers"]["defaults"]["server_flags"][-2:] != ["--max-call-share", "1"]
    for server in result["servers"].values():
        for r in server["rounds"]:
            assert r["backlog_errors"] == []
            assert r["backlog_texts"] == plan["streams"] * plan["texts_per_stream"]
            assert r["calls"] >= 1 and r["ok"] == r["calls"] and r["result_cache_hits"] == 0  # every text new
            assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"] <= r["latency_ms"]["max"]
        assert server["idle"]["calls"] == plan["idle_probes"] and server["idle"]["latency_ms"]["p50"] > 0
        assert server["all_rounds"]["backlog_texts_per_s_median"] > 0
    assert set(result["targets"]) == {"one_text_p99_ms_behind_backlog"}

    page = tmp_path / "BENCHMARKS.md"
    assert bench_main(["report", "--results", str(results), "--out", str(page)]) == 0
    text = page.read_text()
    assert "## One-text calls behind a backlog" in text and "`python -m bench server --scenario backlog" in text


def test_quick_memory_benchmark_samples_the_pods_server_through_every_phase(served_models, tmp_path):
    results = tmp_path / "results"
    code = bench_main(["memory", "--quick", "--setting", "pod", "--models-dir", str(served_models),
                       "--build-cache", str(tmp_path / "build"), "--out-dir", str(results)])
    assert code == 0
    result = json.loads((results / "bench-memory.json").read_text())
    pod = result["settings"]["pod"]
    assert pod["flags"][: len(deployed := pod_flags(served_models))] == deployed  # deploy/k8s/deployment.yaml's
    assert set(pod["peaks"]) == {"loaded", "caches", "steady", "extreme", "spike", "after"}
    assert all(0 < p["pss_mib"] <= p["rss_mib"] for p in pod["peaks"].values())
    assert pod["peak_pss_mib"] == max(p["pss_mib"] for p in pod["peaks"].values())
    assert pod["load"]["phases"]["steady"]["texts_per_s"] > 0
    assert pod["load"]["phases"]["spike"]["calls"].get("OK", 0) > 0
    assert result["pod_limit"]["mib"] > 0 and set(result["targets"]) == {"pod_peak_pss_within_limit",
                                                                         "pod_peak_rss_within_limit"}
    page = tmp_path / "BENCHMARKS.md"
    assert bench_main(["report", "--results", str(results), "--out", str(page)]) == 0
    assert "## Memory under load" in page.read_text()


def test_quick_engine_benchmark_runs_every_system_and_reports_ratios(served_models, tmp_path):
    """Every system, the GRET engines on a model that reads POS tags (each model gets its own
    pieces and tags; its outputs are another model's, so they are not compared with PyTorch's)."""
    out = tmp_path / "bench-engine.json"
    gret = served_models.parent / "runs" / "de-en"  # tests/served.py: GRET with POS tags
    code = bench_main(["engine", "--quick", "--checkpoint", str(served_models / "tiny-en-de"), "--gret-checkpoint",
                       str(gret), "--threads", "2", "--build-dir", str(tmp_path / "build"), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    systems = result["systems"]
    assert {"pytorch", "engine-onnx-fp32", "engine-onnx-int8", "engine-onnx-int8-2w", "ct2-int8", "ct2-int8-2r",
            "gret-engine-onnx-int8-2w"} <= set(systems)  # 2 threads: one loop of 2, or 2 loops (CT2: replicas) of 1
    for f in systems.values():
        assert f["sentences_per_s"] > 0 and f["target_tokens_per_s"] > 0 and 0 <= f["bleu"] <= 100
        assert f["speed_vs_ct2-int8"]["median"] > 0 and f["speed_vs_pytorch"]["median"] > 0
    assert systems["engine-onnx-fp32"]["identical_to_pytorch"] == 1.0  # same math, fp32: same outputs
    assert systems["gret-engine-onnx-fp32"]["identical_to_pytorch"] is None
    assert (tmp_path / "bench-engine.png").read_bytes().startswith(PNG)
    split = systems["engine-onnx-int8-2w"]["time_split"]  # our engine says where its time went
    assert set(split) == {"encode", "decoder", "search", "cache"}
    assert sum(split.values()) == pytest.approx(1, abs=0.01)
    assert systems["ct2-int8"]["time_split"] is None
    assert result["settings"]["sentences"] == 64
    assert {"best_engine_vs_ct2_int8", "best_engine_vs_fastest_ct2_int8"} <= set(result["targets"])


def test_quick_http_benchmark_drives_both_transports_on_one_server(served_models, tmp_path):
    results = tmp_path / "results"
    code = bench_main(["http", "--quick", "--seconds", "3", "--models-dir", str(served_models), "--model", "tiny-de-en",
                       "--threads", "1", "--build-cache", str(tmp_path / "build"), "--out-dir", str(results)])
    assert code == 0
    result = json.loads((results / "bench-http.json").read_text())
    assert {(p["workload"], p["transport"]) for p in result["points"]} == {
        (w, t) for w in ("beam4", "greedy") for t in ("grpc", "http")}
    for point in result["points"]:
        assert point["ok"] > 0 and point["errors"] == {} and point["texts_per_s"] > 0
    assert all(r["median"] > 0 for r in result["http_over_grpc"].values())


def test_the_step_line_weighs_each_point_against_its_own_time():
    """0.2 ms fixed + 60 us per row, with the 256-row point 1 ms slow (the noise of a 16 ms step here): the fit
    keeps the fixed cost at 0.2 ms, where a plain least-squares line gives 0.09."""
    from bench.step import line

    points = [(r, 0.2 + 0.06 * r) for r in (1, 4, 16, 32, 64, 128)] + [(256, 0.2 + 0.06 * 256 + 1.0)]
    fit = line(points)
    assert abs(fit["fixed_ms"] - 0.2) < 0.01 and abs(fit["per_row_us"] - 60) < 2
    assert line([(r, 0.2 + 0.06 * r) for r in (1, 8, 64)]) == {"fixed_ms": 0.2, "per_row_us": 60.0}


def test_quick_step_benchmark_fits_each_architecture_and_phase_and_the_report_renders_it(served_models, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr("bench.step.results_dir", lambda publish: tmp_path)
    gret = served_models.parent / "runs" / "de-en"
    code = bench_main(["step", "--quick", "--checkpoints", str(served_models / "tiny-en-de"), str(gret),
                       "--architectures", "vanilla", "gret", "--precisions", "int8",
                       "--build-dir", str(tmp_path / "build")])
    assert code == 0
    result = json.loads((tmp_path / "bench-step.json").read_text())
    assert set(result["graph"]) == {"vanilla", "gret"}
    for by_precision in result["graph"].values():
        f = by_precision["int8"]
        assert f["rows"] == [1, 8] and all(ms > 0 for ms in f["ms"]) and {"fixed_ms", "per_row_us"} <= set(f)
    assert set(result["engine"]) == {"tiny-en-de", "de-en"}
    for f in result["engine"].values():
        assert [p["in_flight"] for p in f["points"]] == [1, 4]
        for p in f["points"]:  # a step carries at least its texts' first rows, and every phase took time
            assert p["steps"] > 0 and p["rows"] >= 1 and p["texts_per_s"] > 0
            assert set(p["ms"]) == {"encode", "decoder", "search", "cache"} and p["ms"]["decoder"] > 0
        assert set(f["fit"]) == {"encode", "decoder", "search", "cache", "step"}
    cold = result["graph"]["vanilla"]["int8"]["cold_ms"]  # the same step with its memory evicted first
    assert len(cold) == 2 and all(ms > 0 for ms in cold)
    assert set(result["ops"]) == {"tiny-en-de", "de-en"}
    for f in result["ops"].values():  # the profiled loop ran every graph (a capsule model's global one too)
        graphs = set(f["ms_per_text"])
        assert f["in_flight"] == 4 and graphs - {"global", "decoder2"} == {"encoder", "decoder"}
        assert f["ms_per_text"]["decoder"]["GroupQueryAttention"] > 0
        assert all(sum(ops.values()) > 0 for ops in f["ms_per_text"].values())
    assert (tmp_path / "bench-step.png").read_bytes().startswith(PNG)

    page = tmp_path / "BENCHMARKS.md"
    assert bench_main(["report", "--results", str(tmp_path), "--out", str(page)]) == 0
    text = page.read_text()
    assert "## One step: fixed overhead and cost per row" in text and "`python -m bench step --quick" in text
    assert "| `gret` | int8 |" in text and "`de-en` line" in text
    assert "| `GroupQueryAttention` |" in text and "`de-en` decoder" in text and "warm → cold" in text


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on CUDA the run times the kernels too")
def test_kernel_benchmark_without_cuda_times_the_references_and_the_report_renders_it(tmp_path):
    from kernels.bench import main as kernels_bench

    report = kernels_bench(["--out", str(tmp_path / "bench-kernels-float32.json"), "--reps", "1", "--batch", "2"])
    assert report["kernel_timings"] == "reference only (no CUDA)" and "model" not in report
    assert all(k["reference_ms"] > 0 and k["triton_ms"] is None for k in report["kernels"])
    page = tmp_path / "BENCHMARKS.md"
    assert bench_main(["report", "--results", str(tmp_path), "--out", str(page)]) == 0
    section = page.read_text().split("## Triton kernels on a GPU", 1)[1]
    assert report["command"] in section
    assert section.count("| routing |") == 2 and section.count("| grouped_attention |") == 3


def test_the_grpc_floor_answers_the_closed_loop_and_measures_cpu_per_call(tmp_path):
    import asyncio

    from bench.server import ServerProcess
    from bench.speed import floor_load, window

    floor = ServerProcess("grpc-floor", [], tmp_path, {}, module="bench.grpc_floor")
    try:
        floor.wait_serving(timeout=60)
        point = asyncio.run(floor_load(floor, ["Ein Hund läuft."], 8, window(2, 1)))
    finally:
        floor.stop()
    assert point["ok"] == point["calls"] > 8  # every call answered, several rounds of the 8 callers
    assert point["latency_ms"]["p50"] >= 100  # the pause that spreads the calls out, as the server's are
    assert set(point["ms_per_text"]) == {"client", "server parent"}
    assert all(ms > 0 for ms in point["ms_per_text"].values())


def test_the_startup_benchmark_starts_a_server_on_an_empty_and_on_a_filled_compiler_cache(served_models, tmp_path):
    results = tmp_path / "results"
    assert bench_main(["startup", "--models-dir", str(served_models), "--models", "tiny-de-en", "--calls", "2",
                       "--build-cache", str(tmp_path / "build"), "--out-dir", str(results)]) == 0
    result = json.loads((results / "bench-startup.json").read_text())
    assert result["commit"] and result["settings"] == {"beam": 4, "calls": 2}
    starts = result["models"]["tiny-de-en"]
    assert list(starts) == ["empty cache", "filled cache"]
    for start in starts.values():
        assert start["serving_s"] > 0 and len(start["calls_ms"]) == 2 and all(ms > 0 for ms in start["calls_ms"])
