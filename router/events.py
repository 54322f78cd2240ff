"""Subscribes to every worker's KV events (vLLM's ZMQ publisher) and feeds the prefix index.

Wire format (vLLM ``--kv-events-config`` with the zmq publisher): multipart
messages ``(topic, 8-byte big-endian sequence, msgpack batch)``; a batch is the
array ``[ts, events, data_parallel_rank]`` and each event a map tagged by
``type``: BlockStored, BlockRemoved or AllBlocksCleared.

Batches are applied in sequence order (:class:`Stream`). PUB/SUB drops silently (a slow
joiner, a full queue, a reconnect, a restarted engine), so a batch out of order means the
index no longer reflects the worker: the router asks the worker's replay socket (vLLM's
``replay_endpoint``, a ROUTER socket that resends its last ``buffer_steps`` batches from a
sequence number on) for what it missed; when the replay cannot prove it covers the gap, the
worker's entries are dropped and rebuilt from what the replay still holds and new events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from disagg.api import metrics as m

from .adapters import root as adapter_root
from .config import MAX_KV_EVENT_MESSAGE_BYTES, MAX_KV_REPLAY_BYTES
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
    lora_name: str | None = None     # the adapter whose KV these blocks are (router/adapters.py: root)


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
            stored += index.stored(worker, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                                   adapter_root(ev.lora_name))
        elif isinstance(ev, BlockRemoved):
            if ev.medium in GPU_MEDIA:
                index.removed(worker, ev.block_hashes)
        else:
            index.cleared(worker)
    return stored


# vLLM's replay socket ends each answer with sequence -1 (8 bytes, two's complement)
END_SEQ = (1 << 64) - 1
# How long one message of a replay may take: vLLM's publisher thread serves replay requests
# between batches (it polls every 0.1 s when idle), so an answer this late means no replay.
REPLAY_TIMEOUT_S = 5.0

Batches = list[tuple[int, bytes]]
Fetch = Callable[[int], Awaitable[Batches | None]]   # a replay from a sequence number on
Resync = tuple[str, str, int]                         # (reason, outcome, batches missed on the live socket)
DUPLICATE = "duplicate"     # Stream.classify: a batch already applied from a replay


def _contiguous(batches: Batches) -> Batches:
    """The leading run of consecutive sequence numbers."""
    for i in range(1, len(batches)):
        if batches[i][0] != batches[i - 1][0] + 1:
            return batches[:i]
    return batches


class Stream:
    """One worker's event sequence as the index has applied it: classifies each arriving batch
    and repairs the index from a replay. No sockets here (the replay comes through a callable),
    so the gap logic is tested with synthetic batches."""

    def __init__(self, index: PrefixIndex, worker: str, block_size: int | None = None, on_batch=None):
        self.index, self.worker, self.block_size = index, worker, block_size
        self._on_batch = on_batch or (lambda: None)
        self.next: int | None = None        # the sequence expected next; None: nothing applied
        self.last: bytes | None = None      # the batch applied last (seq next-1): a replay that
        #                                     starts with the same bytes continues the same engine
        self.replayed: dict[int, bytes] = {}  # applied from a replay; SUB may still deliver them

    def classify(self, seq: int, payload: bytes) -> str | None:
        """None: the next batch, apply it; DUPLICATE: applied already (from a replay); else the
        reason to resync (a RESYNC_* value)."""
        if self.next is None:
            return None if seq == 0 else m.RESYNC_JOIN
        if seq >= self.next:
            self.replayed.clear()           # SUB has caught up with the replay
            return None if seq == self.next else m.RESYNC_GAP
        if self.replayed.get(seq) == payload:
            return DUPLICATE
        return m.RESYNC_RESTART             # numbering started over: a new engine

    def apply(self, seq: int, payload: bytes) -> None:
        try:
            apply(self.index, self.worker, payload, self.block_size)
        except msgspec.DecodeError as e:    # counted as applied: skipping it keeps the order
            log.warning("undecodable KV event batch from %s: %s", self.worker, e)
        self.next, self.last = seq + 1, payload
        self._on_batch()

    def replay_start(self, reason: str) -> int:
        """Where a replay for ``reason`` starts: for a gap, at the batch applied last (the anchor
        that proves the replay continues this engine's sequence); otherwise from the beginning."""
        return self.next - 1 if reason == m.RESYNC_GAP and self.next else 0

    def covers(self, batches: Batches) -> bool:
        """Whether a replay from :meth:`replay_start` of a gap continues what the index holds."""
        return bool(batches) and self.next is not None and batches[0] == (self.next - 1, self.last)

    def repair(self, reason: str, batches: Batches | None) -> str:
        """Repair the index from ``batches`` (a replay from :meth:`replay_start`, or from 0; None: no
        replay) and return the outcome: RESYNC_REPLAYED when the index again reflects every batch the
        worker published, RESYNC_DROPPED when its entries were dropped and only a suffix rebuilt."""
        if reason == m.RESYNC_GAP and batches is not None and self.covers(batches):
            run = _contiguous(batches)
            for seq, payload in run[1:]:
                self.apply(seq, payload)
            self.replayed = dict(run)
            return m.RESYNC_REPLAYED
        # stale (another engine; or blocks evicted in the gap, which the index would keep forever)
        # or incomplete: start over from what this engine's replay buffer still holds
        self.index.cleared(self.worker)
        self.next, self.last, self.replayed = None, None, {}
        run = _contiguous(batches or [])
        for seq, payload in run:
            self.apply(seq, payload)
        self.replayed = dict(run)
        return m.RESYNC_REPLAYED if run and run[0][0] == 0 else m.RESYNC_DROPPED

    async def resync(self, reason: str, fetch: Fetch | None) -> tuple[str, str]:
        """Ask the replay (``fetch``; None: the worker has none) for what ``reason`` needs and repair;
        returns (reason, outcome), the reason corrected when the replay shows another engine."""
        batches = None
        if fetch is not None:
            start = self.replay_start(reason)
            batches = await fetch(start)
            if reason == m.RESYNC_GAP and batches is not None and not self.covers(batches):
                if not batches or batches[0][0] == start:
                    reason = m.RESYNC_RESTART   # the numbers went on, but not this engine's batches
                # another engine, or the anchor has left the buffer: rebuild from all it still holds
                batches = await fetch(0)
        return reason, self.repair(reason, batches)

    async def join(self, fetch: Fetch) -> Resync | None:
        """Catch up on what the worker published before the router subscribed (a router started
        after its workers, or restarted); None when there was nothing (or no answer)."""
        batches = await fetch(0)
        if not batches:
            return None
        return m.RESYNC_JOIN, self.repair(m.RESYNC_JOIN, batches), batches[-1][0] + 1

    async def receive(self, seq: int, payload: bytes, fetch: Fetch | None) -> Resync | None:
        """One batch from the live socket, applied in order; (reason, outcome, batches missed)
        when it revealed missing batches and the index was resynced."""
        reason = self.classify(seq, payload)
        if reason is None:
            self.apply(seq, payload)
            return None
        if reason == DUPLICATE:
            return None
        missed = seq - self.next if reason == m.RESYNC_GAP else seq
        reason, outcome = await self.resync(reason, fetch)
        # this batch was published before the replay was asked for, so a replay held it; without
        # one, the rebuilt index starts from it
        if self.next is None or seq == self.next:
            self.apply(seq, payload)
        return reason, outcome, missed


async def fetch_replay(ctx: zmq.asyncio.Context, endpoint: str, start: int,
                       timeout: float = REPLAY_TIMEOUT_S) -> Batches | None:
    """Every batch vLLM's replay socket still buffers from ``start`` on; None when it does not answer, or
    answers more than MAX_KV_REPLAY_BYTES (then the caller rebuilds as without a replay).
    The request is ``("", start as 8 bytes big-endian)`` from a DEALER (vLLM's ROUTER socket reads
    identity, empty frame, start); each answer ``("", topic, seq, payload)``, the last with seq -1."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_KV_EVENT_MESSAGE_BYTES)
    sock.connect(endpoint)
    out: Batches = []
    size = 0
    try:
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
            if len(frames) != 4:
                continue
            seq = int.from_bytes(frames[2], "big")
            if seq == END_SEQ:
                return out
            size += len(frames[3])
            if size > MAX_KV_REPLAY_BYTES:
                log.warning("the KV event replay from %s is larger than the router accepts (%d bytes): "
                            "taken as none", endpoint, MAX_KV_REPLAY_BYTES)
                return None
            out.append((seq, frames[3]))
    except asyncio.TimeoutError:
        log.warning("no KV event replay from %s within %.0f s", endpoint, timeout)
        return None
    finally:
        sock.close()


ResyncHook = Callable[[str, str, int], None]    # called with a Resync


class Subscriber:
    """One SUB socket per worker, read by one task each; stopping it drops the worker's blocks.
    With the worker's replay endpoint, the index catches up on join and heals after a gap;
    without it, a gap drops the worker's entries and the index rebuilds from new events."""

    def __init__(self, ctx: zmq.asyncio.Context, index: PrefixIndex, topic: str, on_batch=None,
                 block_size: int | None = None, on_resync: ResyncHook | None = None):
        self._ctx, self._index, self._topic, self._block_size = ctx, index, topic, block_size
        self._on_batch = on_batch or (lambda: None)
        self._on_resync = on_resync or (lambda reason, outcome, missed: None)
        self._tasks: dict[str, asyncio.Task] = {}
        self._discard: dict[str, int] = {}
        self.batches = 0

    def watch(self, worker: str, endpoint: str, replay: str | None = None) -> None:
        if worker not in self._tasks:
            self._tasks[worker] = asyncio.create_task(self._run(worker, endpoint, replay),
                                                      name=f"kv-events {worker}")

    def unwatch(self, worker: str) -> None:
        task = self._tasks.pop(worker, None)
        if task:
            task.cancel()
        self._discard.pop(worker, None)
        self._index.cleared(worker)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for worker in list(self._tasks):
            self.unwatch(worker)
        # until each task has closed its sockets, terminating the ZMQ context would block forever
        await asyncio.gather(*tasks, return_exceptions=True)

    def discard(self, worker: str, n: int) -> None:
        """Fault injection for tests: the next ``n`` batches from ``worker`` are dropped as if the
        socket had lost them."""
        self._discard[worker] = n

    def discarding(self, worker: str) -> int:
        """How many batches :meth:`discard` still has to drop."""
        return self._discard.get(worker, 0)

    def _applied(self) -> None:
        self.batches += 1
        self._on_batch()

    async def _run(self, worker: str, endpoint: str, replay: str | None) -> None:
        stream = Stream(self._index, worker, self._block_size, self._applied)
        fetch = None if replay is None else (lambda start: fetch_replay(self._ctx, replay, start))
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        # a larger batch drops the connection (ZMQ reconnects; the gap is then resynced), never the router
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_KV_EVENT_MESSAGE_BYTES)
        sock.setsockopt_string(zmq.SUBSCRIBE, self._topic)
        sock.connect(endpoint)
        try:
            if fetch is not None:           # SUB queues new batches meanwhile
                self._resynced(worker, await stream.join(fetch))
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                if self._discard.get(worker):
                    self._discard[worker] -= 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                self._resynced(worker, await stream.receive(seq, frames[2], fetch))
        finally:
            sock.close()

    def _resynced(self, worker: str, resync: Resync | None) -> None:
        if resync is None:
            return
        reason, outcome, missed = resync
        log.log(logging.INFO if outcome == m.RESYNC_REPLAYED else logging.WARNING,
                "KV index of %s resynced (%s, %d batches missed): %s", worker, reason, missed, outcome)
        self._on_resync(reason, outcome, missed)
