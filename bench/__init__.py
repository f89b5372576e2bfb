"""Benchmarks that compare systems side by side in one run and report ratios.

    python -m bench engine [--quick]   offline decoding: our engine vs CTranslate2 vs PyTorch
    python -m bench server [--quick]   gRPC load: latency vs offered load per batching policy
    python -m bench replicas --repository REPO   engine loops as threads vs worker processes
    python -m bench report             docs/BENCHMARKS.md from docs/results/bench-*.json
    python -m bench.soak               the 10-minute soak at ~70% of saturation
"""
