"""Environments for tool-use and multi-turn rollouts (issue 26, in progress): the sandboxed Python runner a code
tool executes the model's code with (:mod:`treejax.envs.sandbox`)."""
