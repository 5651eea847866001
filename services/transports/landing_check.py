"""Verifying a weight version's bucket checksums while its bytes land (grpc_stream's receive side).

The stream copies each ≤ 1 MiB chunk into the receive segment on the event loop. Hashing a 64 MiB
bucket once its last chunk has landed reads it back from memory (~19 ms for 221 MiB on this project's
CPU machine), and the last bucket's hash runs after the stream, in the stage's critical path. Instead,
one thread per stage hashes every chunk right after its copy, while its bytes are still in cache (~7 ms
for the same bytes), and a bucket's digest is compared as soon as its last chunk is hashed, so the
stream ends with at most one chunk left to hash. The loop only enqueues ranges; xxh3's `update`
releases the GIL, so the hashing runs beside the stream.

Chunks arrive in order (the learner sends each bucket front to back); a bucket whose chunks come
otherwise, or an algorithm without an incremental form (wsum64), is verified whole in a thread once
complete. The bytes hashed are the segment's (what the engine loads), not the messages'.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future

from services.common import checksums, weights

_END = None  # the thread's last queue item


class LandingCheck:
    """Checksums of `manifest`'s buckets over `buf`, computed as `landed` reports their bytes."""

    def __init__(self, buf: memoryview, manifest: weights.Manifest) -> None:
        self._buf, self._manifest = buf, manifest
        self._new_hasher = checksums.streaming(manifest.algorithm)
        self._next = {b.index: b.offset for b in manifest.buckets}  # where each bucket's in-order hash is
        self._whole: set[int] = set()  # buckets verified whole once complete (chunks out of order)
        self._checks: list[asyncio.Future[None]] = []
        self._queue: queue.SimpleQueue[tuple[weights.BucketEntry, int, int] | None] = queue.SimpleQueue()
        self._done: Future[None] = Future()  # the hashing thread's outcome
        self._stopped = False
        if self._new_hasher is not None:
            threading.Thread(target=self._hash_in_order, name="landing-check", daemon=True).start()
        else:
            self._done.set_result(None)

    def landed(self, bucket: weights.BucketEntry, offset: int, size: int, complete: bool) -> None:
        """`size` bytes of `bucket` now sit at `offset`; `complete`: they were its last ones. Raises the
        DataLoss of a bucket already found corrupt, so the stream stops early."""
        if self._done.done() and not self._stopped:
            self._done.result()  # the thread ended early only by raising
        in_order = bucket.index not in self._whole and offset == self._next[bucket.index]
        if self._new_hasher is not None and in_order:
            self._queue.put((bucket, offset, size))
            self._next[bucket.index] += size
        else:
            self._whole.add(bucket.index)
        if complete and bucket.index in self._whole:  # every bucket, without an incremental hasher
            check = asyncio.to_thread(weights.verify_bucket, self._buf, self._manifest, bucket)
            self._checks.append(asyncio.ensure_future(check))

    async def finish(self) -> None:
        """Wait until every bucket is verified; raises DataLoss naming a corrupt one."""
        await asyncio.gather(*self.stop())

    def stop(self) -> list[asyncio.Future[None]]:
        """End the hashing thread once the chunks enqueued so far are hashed; the futures of everything
        still reading the buffer (hand the buffer to someone else only once they are done)."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_END)
        return [*self._checks, asyncio.wrap_future(self._done)]

    def _hash_in_order(self) -> None:
        hashers: dict[int, checksums.Hasher] = {}
        try:
            while (item := self._queue.get()) is not _END:
                bucket, offset, size = item
                hasher = hashers.get(bucket.index)
                if hasher is None:
                    hasher = hashers[bucket.index] = self._new_hasher()  # type: ignore[misc]
                hasher.update(self._buf[offset : offset + size])
                if offset + size == bucket.offset + bucket.nbytes:
                    weights.check_digest(self._manifest, bucket, hashers.pop(bucket.index).hexdigest())
        except BaseException as exc:  # handed to the loop through the future
            self._done.set_exception(exc)
            return
        self._done.set_result(None)
