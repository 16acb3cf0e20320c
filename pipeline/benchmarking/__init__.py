"""Benchmarking below the stage layer: the variants compared (torch, exported packages), what is
measured on one of them (accuracy, latency, throughput, peak memory, serving), the passes that decide
which variants read which images, the table rows, the benchmark's report and the run summary."""
