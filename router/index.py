"""Which worker holds which prompt prefix, keyed by hashes the router computes.

A block's key chains its parent's key with its token ids, so equal keys mean
equal prefixes, and the index never depends on an engine's private hash seed
(vLLM's event hashes are used only to find a stored block's parent and to
remove blocks). Keys are CPython's hash of ``(parent, tokens)`` tuples of ints,
which is the same in every process (only str/bytes hashing is randomised).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ROOT = 0x5EED  # parent key of a prompt's first block


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """Chained keys of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Block key -> workers holding it, plus each worker's engine-hash -> key map."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._keys: dict[str, dict[object, int]] = {}   # worker -> engine hash -> key

    # ---- ingest (from KV events)
    def stored(self, worker: str, engine_hashes: Sequence[object], parent_engine_hash: object | None,
               token_ids: Sequence[int], block_size: int) -> int:
        """Index blocks a worker stored; returns how many were indexed. Blocks whose parent the
        index has never seen (events missed before the router subscribed) cannot be keyed."""
        keys_of = self._keys.setdefault(worker, {})
        if parent_engine_hash is None:
            parent = ROOT
        else:
            parent = keys_of.get(parent_engine_hash)
            if parent is None:
                return 0
        # one pass: chain the key, remember it under the engine's hash, add the worker
        holders_of = self._holders
        n = 0
        for engine_hash, start in zip(engine_hashes, range(0, len(token_ids) - block_size + 1, block_size)):
            parent = hash((parent, tuple(token_ids[start:start + block_size])))
            keys_of[engine_hash] = parent
            holders = holders_of.get(parent)
            if holders is None:
                holders_of[parent] = {worker}
            else:
                holders.add(worker)
            n += 1
        return n

    def add_keys(self, worker: str, keys: Iterable[int]) -> None:
        """Index router keys directly (tests, simulations, the trace replay)."""
        keys_of = self._keys.setdefault(worker, {})
        holders_of = self._holders
        for key in keys:
            keys_of[key] = key
            holders = holders_of.get(key)
            if holders is None:
                holders_of[key] = {worker}
            else:
                holders.add(worker)

    def removed(self, worker: str, engine_hashes: Iterable[object]) -> None:
        keys_of = self._keys.get(worker)
        if not keys_of:
            return
        for engine_hash in engine_hashes:
            key = keys_of.pop(engine_hash, None)
            if key is None:
                continue
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[key]

    def cleared(self, worker: str) -> None:
        self.removed(worker, list(self._keys.get(worker, ())))
        self._keys.pop(worker, None)

    # ---- query
    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """For each worker holding the first block, how many leading blocks it holds."""
        if not keys:
            return {}
        first = self._holders.get(keys[0])
        if not first:
            return {}
        live = set(first)
        overlap: dict[str, int] = {}
        depth = 1
        for key in keys[1:]:
            holders = self._holders.get(key)
            if not holders:
                break
            if not live <= holders:          # someone's prefix ends here (checked without allocating)
                gone = live - holders
                for worker in gone:
                    overlap[worker] = depth
                live -= gone
                if not live:
                    break
            depth += 1
        for worker in live:
            overlap[worker] = depth
        return overlap

    def blocks(self, worker: str | None = None) -> int:
        return len(self._holders) if worker is None else len(self._keys.get(worker, ()))
