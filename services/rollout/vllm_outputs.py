"""vLLM's outputs as the rollout reads them: behaviour logprobs of sampled tokens, and a finished
completion's text decoded once with the Rust tokenizer (instead of vLLM's detokenizer per token)."""

from __future__ import annotations

from typing import Any


def token_logprob(position: Any, token: int) -> float:
    """Logprob of `token` in one position of vLLM logprobs ({id: Logprob} or a flat view of it)."""
    entry = position[token]
    return float(entry.logprob)


def fast_decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer vLLM's `FastIncrementalDetokenizer` decodes with, or None (slow tokenizer)."""
    if tokenizer is None:
        return None
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer

    return tokenizer._tokenizer if uses_fast_detokenizer(tokenizer) else None


def completion_text(decoder: Any, prompt_token_ids: list[int], token_ids: list[int], stop: bool) -> str:
    """The text vLLM's fast detokenizer gives a finished completion (no stop strings, special tokens
    skipped): a `DecodeStream` primed with the prompt, fed the completion; a completion that ended
    on a stop token (`stop`) leaves that token out, as vLLM does.

    One `step` with all tokens gives the same text as vLLM's step per token, unless the last tokens
    leave a character unfinished: then (and on a decoder error) per token, with vLLM's recovery.
    """
    from tokenizers.decoders import DecodeStream

    ids = list(token_ids[:-1] if stop else token_ids)
    if not ids:
        return ""
    try:
        text = DecodeStream(ids=prompt_token_ids, skip_special_tokens=True).step(decoder, ids)
    except Exception:
        text = None
    if text is not None:
        return text
    stream, pieces = DecodeStream(ids=prompt_token_ids, skip_special_tokens=True), []
    for token in ids:
        try:
            piece = stream.step(decoder, token)
        except (OverflowError, TypeError):
            piece = None
        except Exception as exc:
            if not str(exc).startswith("Invalid prefix encountered"):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            piece = stream.step(decoder, token)
        pieces.append(piece or "")
    return "".join(pieces)


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The logprob of each sampled token from a completion's logprobs (`logprobs=0`).

    With `flat_logprobs` and no top-k alternatives vLLM keeps exactly one entry per position, the
    sampled token: its flat `logprobs` list is the answer as is. Anything else (per-position dicts,
    extra entries) is read position by position.
    """
    if not logprobs:
        if token_ids:
            raise RuntimeError(f"vLLM returned no logprobs for {len(token_ids)} tokens")
        return []
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and len(flat) == len(token_ids) and logprobs.token_ids == token_ids:
        return flat
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    return [token_logprob(logprobs[i], t) for i, t in enumerate(token_ids)]
