"""A codec plug-in: client deltas quantised to int8 with one float32 scale per tensor.

A codec owns a wire format: `encode` (in the client task), `check` (on the server, before
anything else looks at a message: a client can send anything), `decode` (to the dense vector
the aggregator sees). The update's layout (`size`, `dtype`, `segments`: here the model's tensor
sizes) comes from the algorithm. Each tensor t is sent as q_t = round(v_t / s_t) in int8 with
s_t = max|v_t| / 127: 1 byte an entry plus 4 bytes a tensor, about 4x less than float32.
Named in a config as `codec: {name: int8_codec:Int8Delta}`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import raysim


@raysim.plugin("codec")
class Int8Delta:
    def decoded_dtype(self, layout):
        return np.dtype(np.float32)

    def encode(self, vector: np.ndarray, layout) -> dict[str, np.ndarray]:
        segments = layout.segments or (len(vector),)
        quantised = np.empty(len(vector), dtype=np.int8)
        scales = np.empty(len(segments), dtype=np.float32)
        start = 0
        for i, size in enumerate(segments):
            piece = vector[start : start + size]
            peak = float(np.abs(piece).max()) if size else 0.0
            scales[i] = peak / 127 if peak > 0 else 1.0
            quantised[start : start + size] = np.clip(np.rint(piece / scales[i]), -127, 127)
            start += size
        return {"q": quantised, "scales": scales}

    def decode(self, message: dict[str, np.ndarray], layout) -> np.ndarray:
        segments = layout.segments or (len(message["q"]),)
        scales = np.repeat(message["scales"], segments)
        return message["q"].astype(np.float32) * scales

    def check(self, message, layout) -> str | None:
        """Why a message is malformed (one line), or None."""
        if not isinstance(message, Mapping) or set(message) != {"q", "scales"}:
            return "expected a mapping with keys 'q' and 'scales'"
        q, scales = message["q"], message["scales"]
        segments = layout.segments or ((layout.size,) if layout.size is not None else ())
        if not isinstance(q, np.ndarray) or q.dtype != np.int8 or q.ndim != 1:
            return f"'q' must be a 1-D int8 array, got {getattr(q, 'dtype', type(q).__name__)}"
        if layout.size is not None and len(q) != layout.size:
            return f"'q' has {len(q)} entries, expected {layout.size}"
        if not isinstance(scales, np.ndarray) or scales.dtype != np.float32 or scales.ndim != 1:
            return "'scales' must be a 1-D float32 array"
        if segments and len(scales) != len(segments):
            return f"'scales' has {len(scales)} entries, expected one per tensor ({len(segments)})"
        if not (np.isfinite(scales).all() and (scales > 0).all()):
            return "'scales' must be finite and > 0"
        return None
