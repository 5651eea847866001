"""`python -m services.env [--flags]`: run the Environment service (server.py; = `grpo-mesh serve env`).
`python -m services.env check SPEC [--n N]` smoke-tests an environment before training, single-turn
or multi-turn (check.py; = `grpo-mesh check-env SPEC`)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["check"]:
        from services.env.check import main as check

        sys.exit(check(sys.argv[2:]))
    from services.env.server import main

    main()
