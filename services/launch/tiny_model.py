"""The embedded default model: a tiny Qwen2 with a tokenizer built locally (no downloads).

`build_tiny_model` writes a Hugging Face model directory that transformers and vLLM both load:
a byte-level BPE tokenizer (digits always split one per token, ChatML chat template) trained on
arithmetic strings and a little English, and a small Qwen2ForCausalLM (fp32, tied embeddings).
With `warm_start_steps > 0` the model first gets a brief supervised warm start on the default
arithmetic task (prompt "37+45=" → completion "82<eos>"), so GRPO starts from a policy that is
sometimes right - the signal RL needs - rather than from noise.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import torch

from services.env.builtins.arithmetic import ArithmeticOptions, make_problem

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_ENGLISH = (
    "the answer is question solve compute what how many total each step because therefore so "
    "user assistant system you are a helpful model please think reason final <answer> </answer> "
    "<think> </think> + - * / = ( ) . , ? ! : ; # ####"
)


def _corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    options = ArithmeticOptions(digits=3, terms=3, operators="+-*")
    lines = [_ENGLISH] * 20
    for _ in range(n):
        prompt, answer = make_problem(rng, options)
        lines.append(prompt + answer)
    return lines


def build_tokenizer(seed: int = 0, vocab_size: int = 384):
    """Byte-level BPE (any text encodes) whose pre-tokenizer splits every digit on its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Qwen2.5-0.5B's shape (the released model's config.json; 494M parameters), for `build_config`'s
# `shape`: a benchmark model of a real model's width, depth, attention and vocabulary, with random
# weights and the demo's tokenizer (its 384 tokens are the first ids of the 151,936; a random model
# samples the others too, which decode to nothing).
QWEN2_5_0_5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, rope_theta=1000000.0,
    tie_word_embeddings=True,
)  # fmt: skip


def build_config(vocab_size: int, eos_id: int, hidden: int = 128, layers: int = 2, shape: dict | None = None):
    """A Qwen2 config of this tokenizer: `hidden` wide (a multiple of 64: heads of 64), MLP 3×hidden,
    `layers` deep, one KV head per two query heads. The default (128 × 2) is the demo's 0.3M model;
    the benchmarks build bigger ones of the same family (512 × 10 ≈ 29M parameters). `shape` replaces
    any of these fields (`QWEN2_5_0_5B`: a real model's shape)."""
    from transformers import Qwen2Config

    if hidden % 64:
        raise ValueError(f"hidden must be a multiple of 64 (heads of 64), got {hidden}")
    heads = hidden // 64
    fields = dict(
        vocab_size=(vocab_size + 63) // 64 * 64,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="float32",
    )
    return Qwen2Config(**{**fields, **(shape or {})})


def warm_start(
    model, tokenizer, steps: int, seed: int, batch_size: int = 64, lr: float = 3e-3, options=None
) -> float:
    """Supervised steps on arithmetic answers (loss on answer+EOS tokens only). Returns final loss."""
    rng = random.Random(seed + 1)
    options = options or ArithmeticOptions()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * (1 - s / steps)
    )
    eos = tokenizer.eos_token_id
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        rows, masks = [], []
        for _ in range(batch_size):
            prompt, answer = make_problem(rng, options)
            p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(p_ids + a_ids)
            masks.append([0] * len(p_ids) + [1] * len(a_ids))
        width = max(map(len, rows))
        ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows])  # [B, T]
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)  # [B, T]
        logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        )  # [B, T-1]
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


# The demo's task: one-digit operands, two terms, + and -. Learnable by the tiny model in seconds of
# supervised warm start; a short warm start leaves it right about a third of the time at T=1.
DEMO_TASK = {"digits": 1, "terms": 2, "operators": "+-"}


def build_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    warm_start_steps: int = 0,
    task: dict | None = None,
    hidden: int = 128,
    layers: int = 2,
    shape: dict | None = None,
) -> Path:
    """Build (atomically) the tiny model into `out_dir` unless it already exists. Returns `out_dir`.

    `task` holds the arithmetic options used for the warm start (default: `DEMO_TASK`); `hidden` and
    `layers` size the model, `shape` overrides any config field (see `build_config`).
    """
    from transformers import Qwen2ForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(seed)
    config = build_config(len(tokenizer), tokenizer.eos_token_id, hidden, layers, shape)
    model = Qwen2ForCausalLM(config).float()
    task = dict(DEMO_TASK if task is None else task)
    info: dict = {
        "seed": seed,
        "warm_start_steps": warm_start_steps,
        "task": task,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if warm_start_steps:
        options = ArithmeticOptions(**task)
        info["warm_start_final_loss"] = warm_start(model, tokenizer, warm_start_steps, seed, options=options)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "grpo_mesh_model.json").write_text(json.dumps(info, indent=2))
    try:
        tmp.rename(out_dir)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
