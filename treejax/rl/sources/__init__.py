"""Rollout sources as a declared chain of stages (:mod:`treejax.rl.sources.base`).

Importing this package imports no stage module: the stages are listed in :mod:`treejax.rl.sources.catalog`."""
