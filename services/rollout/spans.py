"""Weight-version spans of a completion: which tokens were sampled by which weight version (pure).

vLLM reports `CompletionOutput.weight_versions` as string labels with [start, end) token ranges;
these helpers turn them into integer `VersionSpan`s and check that they tile the completion.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.rollout.engine import VersionSpan


def spans_from_labels(
    labels: Iterable[tuple[str, int, int]] | None, num_tokens: int, fallback_version: int
) -> tuple[VersionSpan, ...]:
    """Integer version spans from engine labels (version string, start, end), checked to cover exactly.

    Adjacent spans with the same version merge. `labels` None (the engine reported no label) means
    the whole completion is attributed to `fallback_version`. Raises ValueError if the labels do not
    tile [0, num_tokens) or a label is not an integer version.
    """
    if labels is None:
        return (VersionSpan(fallback_version, 0, num_tokens),) if num_tokens else ()
    spans: list[VersionSpan] = []
    for label, start, end in labels:
        if end <= start:
            continue
        try:
            version = int(label)
        except ValueError as exc:
            raise ValueError(f"weight version label {label!r} is not an integer") from exc
        if spans and spans[-1].version == version and spans[-1].end == start:
            spans[-1] = VersionSpan(version, spans[-1].start, end)
        else:
            spans.append(VersionSpan(version, start, end))
    check_spans(spans, num_tokens)
    return tuple(spans)


def check_spans(spans: Sequence[VersionSpan], num_tokens: int) -> None:
    """Spans must tile [0, num_tokens) in order, without gaps or overlaps, versions non-decreasing."""
    cursor, last_version = 0, None
    for span in spans:
        if span.start != cursor or span.end <= span.start:
            raise ValueError(f"version spans {list(spans)} do not tile [0, {num_tokens})")
        if last_version is not None and span.version < last_version:
            raise ValueError(f"version spans {list(spans)} go backwards")
        cursor, last_version = span.end, span.version
    if cursor != num_tokens:
        raise ValueError(f"version spans {list(spans)} cover {cursor} of {num_tokens} tokens")
