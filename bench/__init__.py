"""SwiftKV benchmarks: `python -m bench {demo,prefill,throughput,kvcache,memory,gpu,all}`.

Every sub-benchmark shares one timing harness (`bench.harness`: warm-up, repetitions interleaved
across the compared cases, median and spread, ratios pair by pair) and one output format
(`bench.report`: a printed table, a JSON file with the settings and machine info, a PNG plot).
"""
