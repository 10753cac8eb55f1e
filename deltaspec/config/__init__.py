"""Configuration, in frozen dataclasses: `model` (the architecture, `ModelConfig`), `engine` (what the user
chooses about running it, `EngineConfig`, composed of load, host, scheduler, cache, speculative and parallel groups),
`server` (`ServerConfig`), `dtypes` (dtype names), `host` (the default device and CPU threads), `graph_buckets` (the
CUDA-graph buckets), `cache_spec` (`CacheSpec`, the resolved cache facts) and `resolve` (an `EngineConfig`'s "auto"
values decided and its values checked, and the one derivation of its `CacheSpec`)."""
