"""The OpenAI-compatible router: P/D orchestration and KV-aware routing.
Imported as ``disagg.router``."""
