"""Environments for tool-use and multi-turn rollouts (issue 26, in progress): the interface (:mod:`.base`:
``reset`` / ``step`` / ``clone``, a gymnasium adapter), a sandboxed Python runner (:mod:`.sandbox`), a code tool for
math and reasoning-gym tasks (:mod:`.code_tool`) and a guessing game with feedback (:mod:`.guess`). The sampler
and the turn forest that drive them are not built yet."""
