"""The docs are checked: every command README.md, docs/*.md, services/scheduler/README.md and
deploy/k8s/README.md show is parsed by the real parser it would meet (tests/doc_commands.py), every
repo path they name exists, and their RPC counts match protos/. Nothing is run.

The checker's own tests plant wrong commands in small markdown texts and expect each to be reported
with its line; a correct text must pass.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.doc_commands import check_markdown, doc_files
from tests.doc_parsers import ROOT, rpc_count


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services read GRPO_* variables and GRPO_CONFIG: none of the caller's may leak in."""
    for key in list(os.environ):
        if key.upper().startswith("GRPO_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("doc", [str(p.relative_to(ROOT)) for p in doc_files()])
def test_every_documented_command_path_and_count_is_right(doc: str) -> None:
    problems = check_markdown((ROOT / doc).read_text(), doc, ROOT / doc)
    assert not problems, f"{len(problems)} problem(s) in {doc}:\n" + "\n".join(problems)


def test_the_docs_are_found() -> None:
    found = {str(p.relative_to(ROOT)) for p in doc_files()}
    assert "README.md" in found and any(name.startswith("docs/") for name in found)


# ---- the checker ------------------------------------------------------------------------------------

WRONG = textwrap.dedent(
    """\
    # wrong

    ```bash
    grpo-mesh serve scheduler --trace true
    grpo-mesh serve learner --model m \\
      --checkpoint.background false
    make nosuchtarget
    ```

    Run `python -m services.learner --model m --checkpoint.backgroud` or `make demo ARGS="--secure true"`.
    Also `make demo MODLE=smollm2` and `grpo-mesh trian` and `python -m services.scheduler audit runs/demo`.

    ```sh
    grpcurl -plaintext -d '{"n": 2, "splitt": "SPLIT_TRAIN"}' \\
      127.0.0.1:50051 grpo.env.v1.EnvironmentService/SamplePrompts
    grpcurl -plaintext 127.0.0.1:50050 grpo.scheduler.v1.SchedulerService/Stop
    grpcurl -plaintext 127.0.0.1:50050 describe grpo.scheduler.v1.SchedulerServise
    docker compose --profile tpu up; docker compose --profile gpu logs -f scheduler
    .venv/bin/python bench/vs_trl.py --stepz 3
    ```

    ```console
    $ grpo-mesh status --adress 127.0.0.1:50050
    state  --anything true  (output, not a command)
    ```

    The flag `--lend-idle-cores false`; see `services/no_such_module.py` and [recovery](docs/nope.md).
    Synopsis: `grpo-mesh status [--adress HOST:PORT] [--watch]`; all 7 RPCs are fuzzed.
    A JSON value is no synopsis: `grpo-mesh serve scheduler --rollout-addresses '["a:1"]' --max-steps many`.

    ```bash
    grpo-mesh prepare   # a command to run must have its required options (in prose it may be named alone)
    ```
    """
)

EXPECTED = [  # (line, a fragment of the problem)
    (4, "--trace: a boolean flag takes no value (got 'true'); write --trace or --no-trace"),
    (5, "--checkpoint.background: a boolean flag takes no value (got 'false')"),
    (7, "no target 'nosuchtarget'"),
    (10, "--checkpoint.backgroud: no such option"),
    (10, "grpo-mesh demo: error: --secure: a boolean flag takes no value"),
    (11, "the Makefile reads no variable 'MODLE'"),
    (11, "grpo-mesh has no command 'trian'"),
    (11, "python -m services.scheduler: error: unexpected argument 'audit'"),
    (14, "is no grpo.env.v1.SamplePromptsRequest"),
    (16, "no method 'grpo.scheduler.v1.SchedulerService/Stop'"),
    (17, "no symbol 'grpo.scheduler.v1.SchedulerServise'"),
    (18, "no profile 'tpu'"),
    (18, "service 'scheduler' is not in profile gpu"),
    (19, "bench/vs_trl.py: no option --stepz"),
    (23, "grpo-mesh status: error: --adress: no such option"),
    (27, "--lend-idle-cores: booleans are a bare --lend-idle-cores / --no-lend-idle-cores"),
    (27, "services/no_such_module.py: no such file"),
    (27, "link to docs/nope.md: no such file"),
    (28, "--adress: no such option of grpo-mesh status"),
    (28, f"protos/ define {rpc_count()} RPCs, not 7"),
    (29, "grpo-mesh serve scheduler: error: --max-steps: Input should be a valid integer"),
    (32, "grpo-mesh prepare: error: --config: required: The run-config"),
]


def test_the_checker_reports_each_planted_mistake_with_its_line() -> None:
    problems = check_markdown(WRONG, "wrong.md", ROOT / "wrong.md")
    missing = [
        (line, fragment)
        for line, fragment in EXPECTED
        if not any(p.startswith(f"wrong.md:{line}: ") and fragment in p for p in problems)
    ]
    assert not missing, "not reported:\n" + "\n".join(map(str, missing)) + "\n\ngot:\n" + "\n".join(problems)
    assert len(problems) == len(EXPECTED), "\n".join(problems)  # and nothing else (no false alarm)


RIGHT = textwrap.dedent(
    f"""\
    ```bash
    make demo MODEL=smollm2 STEPS=48 ARGS="--env-arg digits=2 --secure --no-lend-idle-cores"
    grpo-mesh serve learner --model .cache/tiny-model-warm120 --no-checkpoint.background --optim.lr 4e-4
    .venv/bin/python -m services.scheduler --port 50050 --rollout-addresses '["127.0.0.1:50052"]' --trace
    python -m services.env --config docker/configs/tiny.toml --port 50051   # a repo run-config, read
    python -m services.rollout --config run.toml --model m                    # an example's: replaced
    python -m services prepare --config /app/configs/tiny.toml
    python -m services.launch demo --steps 3 --resume
    grpo-mesh check-env examples/my_env.py:CountLettersEnv --n 8 --env-arg letter=s
    grpo-mesh audit runs/demo && grpo-mesh certs runs/tls --hosts learner,env
    T=runs/demo/tls; S=127.0.0.1:$(cat runs/demo/scheduler.port)
    grpcurl -cacert $T/ca.pem -H "authorization: Bearer $(cat $T/token)" \\
      $S grpo.scheduler.v1.SchedulerService/GetStatus
    grpcurl -plaintext -d '{{"service": ""}}' 127.0.0.1:50052 grpc.health.v1.Health/Check
    grpcurl -plaintext -d '{{"n": 2, "split": "SPLIT_TRAIN"}}' 127.0.0.1:50051 \\
      grpo.env.v1.EnvironmentService/SamplePrompts
    grpcurl -plaintext 127.0.0.1:50050 describe grpo.scheduler.v1.SchedulerService
    docker compose --profile cpu logs -f scheduler | head
    .venv/bin/python bench/vs_trl.py --steps 60 --skip 5 --trace > out.txt 2>&1
    ```

    `grpo-mesh status [--address HOST:PORT | --run-dir DIR] [--watch] [--until-finished]`,
    `make demo [MODEL=smollm2] [STEPS=N] [RUN_DIR=runs/x] [ARGS="..."]`, `python -m services.<svc> --help`,
    `grpo-mesh serve env|rollout|learner|scheduler [--flags]`, `python -m services.launch demo|prepare`,
    `grpo-mesh check-env SPEC [--n N] [--split eval]`, `grpo-mesh <cmd> --help`, `ARGS="--trace"`,
    `make up PROFILE=gpu GRPO_MESH_CONFIG=tiny.toml`, `services/cli.py`, `scheduler/orchestrator.py`,
    `grpo-mesh audit` and `python -m services prepare` named in prose,
    `runs/demo/ledger.sqlite`, [the docs](docs/recovery.md#anchor), [a section](#section); {rpc_count()} RPCs.
    """
)


def test_a_correct_text_passes() -> None:
    assert check_markdown(RIGHT, "right.md", ROOT / "right.md") == []
