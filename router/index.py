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
    """Block key -> the workers holding it, as a bitmask of worker slots (an int: no set per block,
    and a prefix walk is one AND per block), plus each worker's engine-hash -> key map."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}              # key -> bitmask of worker slots
        self._keys: dict[str, dict[object, int]] = {}   # worker -> engine hash -> key
        self._slot: dict[str, int] = {}                 # worker -> its bit
        self._names: dict[int, str] = {}                # bit -> worker
        self._free: list[int] = []                      # bits of cleared workers, for reuse

    def _bit(self, worker: str) -> int:
        bit = self._slot.get(worker)
        if bit is None:
            bit = self._free.pop() if self._free else 1 << len(self._slot)
            self._slot[worker], self._names[bit] = bit, worker
        return bit

    # ---- ingest (from KV events)
    def stored(self, worker: str, engine_hashes: Sequence[object], parent_engine_hash: object | None,
               token_ids: Sequence[int], block_size: int, root: int = ROOT) -> int:
        """Index blocks a worker stored; returns how many were indexed. Blocks whose parent the
        index has never seen (events missed before the router subscribed) cannot be keyed. ``root``: the
        first block's parent key, its adapter's (router/adapters.py) for blocks computed under a LoRA."""
        keys_of = self._keys.setdefault(worker, {})
        if parent_engine_hash is None:
            parent = root
        else:
            parent = keys_of.get(parent_engine_hash)
            if parent is None:
                return 0
        bit = self._bit(worker)
        holders = self._holders
        get = holders.get
        n = 0
        # one pass: chain the key, remember it under the engine's hash, set the worker's bit
        for engine_hash, start in zip(engine_hashes, range(0, len(token_ids) - block_size + 1, block_size)):
            parent = hash((parent, tuple(token_ids[start:start + block_size])))
            keys_of[engine_hash] = parent
            holders[parent] = get(parent, 0) | bit
            n += 1
        return n

    def add_keys(self, worker: str, keys: Iterable[int]) -> None:
        """Index router keys directly (tests, simulations, the trace replay)."""
        keys_of = self._keys.setdefault(worker, {})
        bit = self._bit(worker)
        holders = self._holders
        get = holders.get
        for key in keys:
            keys_of[key] = key
            holders[key] = get(key, 0) | bit

    def removed(self, worker: str, engine_hashes: Iterable[object]) -> None:
        keys_of = self._keys.get(worker)
        if not keys_of:
            return
        keep = ~self._slot[worker]
        holders = self._holders
        for engine_hash in engine_hashes:
            key = keys_of.pop(engine_hash, None)
            if key is None:
                continue
            mask = holders.get(key)
            if mask is not None:
                mask &= keep
                if mask:
                    holders[key] = mask
                else:
                    del holders[key]

    def cleared(self, worker: str) -> None:
        self.removed(worker, list(self._keys.get(worker, ())))
        self._keys.pop(worker, None)
        bit = self._slot.pop(worker, None)
        if bit is not None:                 # no block carries it any more: the slot can be reused
            del self._names[bit]
            self._free.append(bit)

    # ---- query
    def match(self, keys: Sequence[int]) -> dict[str, int]:
        """For each worker holding the first block, how many leading blocks it holds."""
        if not keys:
            return {}
        holders = self._holders
        live = holders.get(keys[0], 0)
        if not live:
            return {}
        overlap: dict[str, int] = {}
        depth = 1
        for key in keys[1:]:
            mask = live & holders.get(key, 0)
            if mask != live:                 # someone's prefix ends here
                gone = live & ~mask
                while gone:
                    low = gone & -gone
                    overlap[self._names[low]] = depth
                    gone ^= low
                live = mask
                if not live:
                    break
            depth += 1
        while live:
            low = live & -live
            overlap[self._names[low]] = depth
            live ^= low
        return overlap

    def keys(self, worker: str) -> set[int]:
        """The block keys indexed for ``worker``."""
        return set(self._keys.get(worker, {}).values())

    def blocks(self, worker: str | None = None) -> int:
        return len(self._holders) if worker is None else len(self._keys.get(worker, ()))
