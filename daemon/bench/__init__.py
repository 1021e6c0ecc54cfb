"""`llmd bench`: load generation and per-stage latency profiling for any OpenAI-compatible endpoint.

    llmd bench                                   # 32 chat requests, one client, against the local daemon
    llmd bench -c 8 -n 64 -w shared-prefix       # 8 concurrent clients, a shared system prompt
    llmd bench --rate 2 --duration 60            # open loop: Poisson arrivals at 2 req/s for a minute
    llmd bench --sweep 1..16 --plot out/         # concurrency 1, 2, 4, 8, 16; PNG plots into out/
    llmd bench --url http://host:8000/v1 --prompts mine.jsonl --json report.json
    llmd bench --compare http://127.0.0.1:8471 http://127.0.0.1:8080

Modules: workloads (what to send), client (one timed streaming request), runner (closed/open loop, sweeps),
report (summary, diagnosis, table/JSON/PNG), compare (two endpoints, alternating), command (the CLI's one call).
Never imports torch; matplotlib only when plots are asked for.
"""
