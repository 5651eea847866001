"""Environment service: prompt sources and isolated scoring (see docs/environments.md).

Public API: `services.env.base` (Environment, PromptItem, Score, Scorer, failure),
`services.env.loader` (load_recipe → LoadedEnv, load_environment, EnvRecipe), `services.env.cursor`
(PromptCursor), `services.env.rewards` (RewardFunctionScorer, format rewards), `services.env.host`
(EnvHost), `services.env.server` (EnvApp, main), `services.env.config` (EnvSettings).
Kept import-free so `services.env.builtins.arithmetic` stays cheap to import.
"""
