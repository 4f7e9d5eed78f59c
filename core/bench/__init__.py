"""The load generator behind ``ifb bench``.

``ifb.bench.workloads`` defines what is sent, ``ifb.bench.driver`` sends it
(streaming, to any OpenAI-compatible server), ``ifb.bench.stats`` turns the
timings into throughput and latency percentiles and ``ifb.bench.plot`` draws them.
"""
