"""The built-in tasks' multi-turn white-box agents (`agent.name`: retry, calculator, sandbox) and their
environment, runnable on the built-in tasks with the tiny model.

Both speak only the task's own alphabet (digits, + and =), so the character tokenizer of
the built-in model can spell every turn:

* `retry`: answer; a wrong answer gets the question again (RetryEnv), up to 3 attempts.
  Reward 1 / 0.5 / 0.25 for the first right attempt, from the environment.
      37+48= | 84<eos> | 37+48= | 85<eos>          model | env | model  (loss_mask 1 | 0 | 1)
* `calculator`: a model turn that ends with "=" is a calculator call on the expression
  before it; an expression that starts with an operator ("+56") goes on from the previous
  call's result. The result is appended and the model goes on. A turn without "=" is the
  final answer, scored by reward.fn on that last turn's text. Turns are bounded by
  agent.max_turns (the trajectory is then `truncated`).
      12+34+56= | 12+34= | 46 | +56= | 102 | 102<eos>  (the model must learn to chain calls)
"""
from __future__ import annotations

import asyncio

from stages.agentflow.envs import Step


class RetryEnv:
    """A question with an exact answer; a wrong answer gets the question again.

    Reward `decay ** (attempt - 1)` for the first correct attempt (1, 0.5, 0.25, ...), 0 if
    every attempt fails, so answering right the first time is always best. Works on any
    built-in task row (`prompt`, `answer`) and spells nothing outside the task's alphabet.
    """

    def __init__(self, sample: dict, max_attempts: int = 3, decay: float = 0.5):
        self.question, self.answer = sample["prompt"], str(sample.get("answer", "")).strip()
        self.max_attempts, self.decay = max_attempts, decay
        self.attempts = 0

    def step(self, action: str) -> Step:
        self.attempts += 1
        if action.strip() == self.answer:
            return Step(reward=self.decay ** (self.attempts - 1), done=True, info={"attempts": self.attempts})
        if self.attempts >= self.max_attempts:
            return Step(done=True, info={"attempts": self.attempts})
        return Step(observation=self.question)


class RetryAgent:
    async def run(self, ctx, sample: dict) -> None:
        env = RetryEnv(sample)
        while True:
            gen = await ctx.generate()
            if (await ctx.step(env, gen.text)).done:
                return


class CalculatorAgent:
    async def run(self, ctx, sample: dict) -> None:
        result = ""
        while True:
            gen = await ctx.generate(stop=["="])
            if not gen.stopped:
                return
            expression = gen.text[:-1]
            if result and expression[:1] in "+-*/%":   # "+56" goes on from the last result: a chained call
                expression = result + expression
            # a malformed expression gets the tool's error text back: that is the model's feedback
            result = await ctx.call_tool("calculator", {"expression": expression})
            if result.startswith("error"):
                result = ""


class SandboxAgent:
    """Compute by running code (the `product` task, stages/tasks/code.py), retrying until right.

    A model turn ending in ";" is a Python snippet: it runs in this trajectory's own sandbox, a session
    of the rollout worker's pool (stages/agentflow/sandbox/pool.py, the `sandbox:` section), through the
    `python` tool, and its output and "=" join the stream; the next turn is the answer, checked by RetryEnv. A failed
    snippet -- an exception or a breached limit -- reads "?=": the tiny model's alphabet cannot
    spell the error, which is kept whole in agent_info (`tool_errors`). A wrong answer gets the
    question again, up to agent.max_turns // 2 attempts (two model turns each).
        37*48*29= | 37*48*29; | 51504= | 51504<eos>        prompt | model | tool | model
    """
    attempts = 12               # when agent.max_turns is 0
    max_observation_chars = 16  # a longer output reads "?": it would fill the tiny model's context

    def __init__(self):
        from stages.agentflow.sandbox.pool import SandboxConfig
        from stages.agentflow.sandbox.tool_service import ToolServiceConfig

        self.sandbox_cfg, self.pool = SandboxConfig(), None
        self.service_cfg, self.service, self.client = ToolServiceConfig(), None, None
        self._starting = asyncio.Lock()     # the concurrent trajectories of a batch wait for one service start

    def configure(self, agent, sandbox=None, tool_service=None) -> None:
        """The recipe's agent, sandbox and tool_service sections (None: the defaults)."""
        self.sandbox_cfg, self.service_cfg = sandbox or self.sandbox_cfg, tool_service or self.service_cfg
        if agent.max_turns:
            self.attempts = max(1, agent.max_turns // 2)

    async def run(self, ctx, sample: dict) -> None:
        if self.sandbox_cfg.remote:
            await self.start_remote()
        session = self.attach(ctx)
        session.prestart()      # the sandbox starts while the model writes its first snippet
        try:
            env = RetryEnv(sample, max_attempts=self.attempts)
            while True:
                gen = await ctx.generate(stop=[";"])
                if gen.stopped:
                    await self.run_snippet(ctx, gen.text[:-1])
                    gen = await ctx.generate()
                if (await ctx.step(env, gen.text)).done:
                    return
        finally:        # the trajectory's sandbox ends with it: nothing it left reaches another trajectory
            await session.close()

    def attach(self, ctx):
        """Give the context the `python` tool of a sandbox of this trajectory's own (a session of this worker's
        pool, started here on the rollout's loop, or of the remote service); returns the session to close."""
        from stages.agentflow.sandbox.pool import SandboxPool

        if not self.sandbox_cfg.remote and self.pool is None:
            self.pool = SandboxPool(self.sandbox_cfg)
        # remote: the client is made by start_remote, awaited before attach
        session = (self.client if self.sandbox_cfg.remote else self.pool).session()
        ctx.tools.register(session.tool())
        return session

    async def run_snippet(self, ctx, code: str) -> None:
        """One sandbox call: its observation joins the stream (in the model's alphabet), a failure agent_info."""
        result = await ctx.tools.call("python", {"code": code})
        ctx.tool_calls += 1
        ctx.add_text(self._observation(ctx.tokenizer, result), role="tool")
        if result.startswith("error"):
            ctx.info.setdefault("tool_errors", []).append(result[:300])

    def _observation(self, tok, result: str) -> str:
        """The output and "=", or "?=" for a failure (or an output the model should not read), or "="
        where the vocabulary has no "?"."""
        text = result.strip()
        ok = not result.startswith("error") and text and len(text) <= self.max_observation_chars
        for obs in ([text + "="] if ok else []) + ["?=", "="]:
            try:
                tok(obs, add_special_tokens=False)
                return obs
            except Exception:  # noqa: BLE001 - a character the vocabulary lacks
                continue
        return ""

    async def start_remote(self) -> None:
        """The remote sandbox's client; with no tool_service.url, this worker's own service, started once."""
        from stages.agentflow.sandbox.tool_service import ToolService, ToolServiceClient

        async with self._starting:
            if self.client is not None:
                return
            url = self.service_cfg.url
            if not url:
                self.service = ToolService(self.service_cfg, sandbox=self.sandbox_cfg)
                url = await asyncio.to_thread(self.service.start)
            self.client = ToolServiceClient(url, self.service_cfg, key=self.service.key if self.service else None)

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.client is not None:
            await self.client.close()
        if self.service is not None:
            await asyncio.to_thread(self.service.stop)


BUILTIN_AGENTS = {"retry": RetryAgent, "calculator": CalculatorAgent, "sandbox": SandboxAgent}
