"""vLLM worker extension: load a packed state_dict from a POSIX shared-memory segment, in place.

vLLM appends this class to its worker's bases (`worker_extension_cls=`), and the rollout calls
`grpo_load_from_shm` through `AsyncLLM.collective_rpc` on every worker. Arguments are plain
strings / int lists (vLLM's msgpack RPC rejects dtypes and does not reliably carry tensors), and the
worker rebuilds zero-copy tensor views with `torch.frombuffer`: no pickle anywhere.

Loading goes through the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`
(layer-wise, quantisation-safe, works on the CPU backend where plain `model.load_weights` fails).
The tensors are HF-named `state_dict()` items including `lm_head.weight`, so tied heads update.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator

import torch


class GrpoWorkerExtension:
    """Mixed into vLLM's worker class; methods run inside each worker process."""

    def grpo_load_from_shm(
        self,
        segment_name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        offsets: list[int],
        nbytes: list[int],
    ) -> dict[str, float]:
        """Attach `segment_name`, load every listed tensor via reload_weights, detach. Returns timings."""
        from services.common.weights import attach_segment, dtype_from_name

        if not len(names) == len(dtypes) == len(shapes) == len(offsets) == len(nbytes):
            raise ValueError("grpo_load_from_shm: names/dtypes/shapes/offsets/nbytes differ in length")
        started = time.perf_counter()
        segment = attach_segment(segment_name)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape, offset, size in zip(names, dtypes, shapes, offsets, nbytes, strict=True):
                if offset + size > segment.size:
                    raise ValueError(f"tensor {name} lies outside segment {segment_name}")
                flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=size, offset=offset)
                yield name, flat.view(dtype_from_name(dtype)).reshape(shape)

        try:
            self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            loaded = time.perf_counter()
        finally:
            _close(segment)
        return {"worker_load_ms": (loaded - started) * 1e3, "tensors": float(len(names))}


def _close(segment) -> None:
    """Unmap the segment; the frombuffer views normally died with the iterator, else collect them."""
    try:
        segment.close()
    except BufferError:
        gc.collect()
        try:
            segment.close()
        except BufferError:  # a view survived; the mapping goes away with the process
            logging.getLogger(__name__).warning("segment %s still has views after loading", segment.name)
