"""Benchmarking below the stage layer: the variants compared (torch, exported packages), what is
measured on them (accuracy, latency, throughput, peak memory, serving), and the run summary."""
