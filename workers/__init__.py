"""The worker entrypoint: runs vLLM for a prefill or decode role with NIXL KV
transfer. Imported as ``disagg.workers``."""
