"""Stage-level tools and benchmarks (tools/bench/)."""
