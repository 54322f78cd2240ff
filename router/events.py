"""Subscribes to every worker's KV events (vLLM's ZMQ publisher) and feeds the prefix index.

Wire format (vLLM ``--kv-events-config`` with the zmq publisher): multipart
messages ``(topic, 8-byte big-endian sequence, msgpack batch)``; a batch is the
array ``[ts, events, data_parallel_rank]`` and each event a map tagged by
``type``: BlockStored, BlockRemoved or AllBlocksCleared.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from .index import PrefixIndex

log = logging.getLogger("disagg.router.events")
Hash = int | bytes
GPU_MEDIA = (None, "GPU")   # offloaded copies (CPU, disk) are not what a prefill reuses directly


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(Batch)


_warned: set[tuple[str, int]] = set()


def apply(index: PrefixIndex, worker: str, payload: bytes, block_size: int | None = None) -> int:
    """Apply one published batch to the index; returns the blocks it stored. With ``block_size`` (the
    router's), blocks of another size are not indexed: the router's keys could never match them. That
    means the worker runs with a block size other than the one the operator gave both (vLLM overrides
    it for some backends), which is logged once per worker and size."""
    stored = 0
    for ev in _decoder.decode(payload).events:
        if isinstance(ev, BlockStored):
            if ev.medium not in GPU_MEDIA:
                continue
            if block_size is not None and ev.block_size != block_size:
                if (worker, ev.block_size) not in _warned:
                    _warned.add((worker, ev.block_size))
                    log.error("%s stores KV blocks of %d tokens but the router hashes blocks of %d: its prefixes "
                              "are not indexed (set the same --block-size in spec.engine.args for both)",
                              worker, ev.block_size, block_size)
                continue
            stored += index.stored(worker, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
        elif isinstance(ev, BlockRemoved):
            if ev.medium in GPU_MEDIA:
                index.removed(worker, ev.block_hashes)
        else:
            index.cleared(worker)
    return stored


class Subscriber:
    """One SUB socket per worker, read by one task each; stopping it drops the worker's blocks."""

    def __init__(self, ctx: zmq.asyncio.Context, index: PrefixIndex, topic: str, on_batch=None,
                 block_size: int | None = None):
        self._ctx, self._index, self._topic, self._block_size = ctx, index, topic, block_size
        self._on_batch = on_batch or (lambda: None)
        self._tasks: dict[str, asyncio.Task] = {}
        self.batches = 0

    def watch(self, worker: str, endpoint: str) -> None:
        if worker not in self._tasks:
            self._tasks[worker] = asyncio.create_task(self._run(worker, endpoint), name=f"kv-events {worker}")

    def unwatch(self, worker: str) -> None:
        task = self._tasks.pop(worker, None)
        if task:
            task.cancel()
        self._index.cleared(worker)

    async def close(self) -> None:
        for worker in list(self._tasks):
            self.unwatch(worker)

    async def _run(self, worker: str, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, self._topic)
        sock.connect(endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    apply(self._index, worker, frames[2], self._block_size)
                    self.batches += 1
                    self._on_batch()
                except msgspec.DecodeError as e:
                    log.warning("undecodable KV event batch from %s: %s", worker, e)
        finally:
            sock.close()
