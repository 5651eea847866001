"""Environment service: prompt sources and isolated scoring (see docs/environments.md).

Public API: `services.env.base` (Environment, PromptItem, Score), `services.env.loader`
(load_environment, EnvRecipe), `services.env.rewards` (RewardFunctionEnvironment, format rewards).
Kept import-free so `services.env.builtins.arithmetic` stays cheap to import.
"""
