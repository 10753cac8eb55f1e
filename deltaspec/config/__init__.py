"""Configuration, in frozen dataclasses: `model` (the architecture, `ModelConfig`), `engine` (what the user
chooses about running it, `EngineConfig`), `server` (`ServerConfig`), `dtypes` (dtype names), `host` (the default
device and CPU threads) and `resolve` (an `EngineConfig`'s "auto" values decided and its values checked)."""
