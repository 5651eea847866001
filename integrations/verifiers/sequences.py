"""A finished verifiers rollout -> one atropos-shaped training sequence (tokens, mask, score).

verifiers 0.4.0 (`verifiers.v1`) stores a rollout as a message graph (`Trace.nodes`): each node holds
the tokens it adds to the cumulative sequence; a sampled (assistant) node holds the generation-prompt
scaffold followed by the completion the model sampled, with `mask` True on the completion only. A
root-to-leaf path (`Trace.branches`) concatenates to exactly the `prompt_ids + completion_ids` each
model call sent and got back. When a later turn's prompt is NOT the earlier prompt + completion +
new tokens (the renderer could not bridge and a full re-render tokenized the history differently),
the graph forks and the trace has more than one branch: such a rollout is not token-exact and is
refused here with a reason (the runner counts it; nothing from it is submitted).

For an exact rollout the sequence is the single branch's tokens; the mask is the token id where the
model sampled and -100 elsewhere (atropos' convention). Each maximal sampled span [s, e) is one model
call's completion and tokens[:s] is that call's prompt, which is what the gateway's registry checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IGNORE = -100


@dataclass
class Sequence:
    """One rollout, ready for a ScoredData group."""

    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    score: float
    session_id: str
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Rejected:
    """A rollout that cannot be trained on, and why (`kind` is the counter it goes to)."""

    kind: str
    reason: str
    session_id: str = ""


def sampled_spans(mask: list[bool]) -> list[tuple[int, int]]:
    """The maximal runs [s, e) of True in `mask`."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, sampled in enumerate(mask):
        if sampled and start is None:
            start = i
        elif not sampled and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def episode_sequence(episode) -> Sequence | Rejected:
    """The training sequence of a finished `vf.Episode` with one trace (the single-agent case and any
    env whose `run()` plays one agent), or why there is none."""
    if not episode.ok:
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        for trace in episode.traces:
            errors += [f"{e.type}: {e.message}" for e in trace.errors]
        return Rejected("failed", "; ".join(errors)[:500] or "the episode did not complete")
    if len(episode.traces) != 1:
        return Rejected(
            "multi_agent", f"the episode has {len(episode.traces)} traces; one agent per episode is supported"
        )
    return trace_sequence(episode.traces[0])


def trace_sequence(trace) -> Sequence | Rejected:
    """The training sequence of one finished `vf.Trace`, or why it is not token-exact / not usable."""
    sid = trace.id
    branches = [b for b in trace.branches if b.trainable]
    if len(branches) != 1:
        return Rejected(
            "not_token_exact",
            f"{len(branches)} token branches: a later turn's prompt is not the earlier prompt + completion + "
            "new tokens (the renderer re-rendered the history and it tokenized differently)",
            sid,
        )
    branch = branches[0]
    sampled_nodes = [node for node in branch.nodes if node.sampled]
    if len(sampled_nodes) != len(branch.calls):
        return Rejected(
            "not_token_exact", f"{len(branch.calls)} model calls but {len(sampled_nodes)} sampled nodes", sid
        )
    tokens: list[int] = []
    mask: list[bool] = []
    for node in branch.nodes:
        if len(node.mask) != len(node.token_ids):
            return Rejected(
                "no_tokens", "a node carries no per-token mask (a relay client records no tokens)", sid
            )
        n = sum(node.mask)
        # a sampled node is scaffold then completion: its True entries are one suffix run
        if n and not all(node.mask[len(node.mask) - n :]):
            return Rejected(
                "not_token_exact", "a sampled node's completion is not one contiguous suffix", sid
            )
        if n and not node.sampled:
            return Rejected("not_token_exact", "a prompt-supplied node is marked as sampled", sid)
        tokens.extend(node.token_ids)
        mask.extend(node.mask)
    spans = sampled_spans(mask)
    if len(spans) != sum(1 for node in sampled_nodes if sum(node.mask)):
        # two completions with nothing between them would read as one generation
        return Rejected(
            "not_token_exact", "two sampled completions are adjacent (no prompt tokens between them)", sid
        )
    if not spans:
        return Rejected("empty", "the model sampled no tokens", sid)
    masks = [tok if m else IGNORE for tok, m in zip(tokens, mask, strict=True)]
    logprobs = branch.logprobs
    return Sequence(tokens, masks, list(logprobs), float(trace.reward), sid, spans)
