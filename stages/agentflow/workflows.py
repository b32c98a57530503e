"""Built-in multi-turn white-box agents, runnable on the built-in tasks with the tiny model.

Both speak only the task's own alphabet (digits, + and =), so the character tokenizer of
the built-in model can spell every turn:

* `retry`: answer; a wrong answer gets the question again (RetryEnv), up to 3 attempts.
  Reward 1 / 0.5 / 0.25 for the first right attempt, from the environment.
      37+48= | 84<eos> | 37+48= | 85<eos>          model | env | model  (loss_mask 1 | 0 | 1)
* `calculator`: a model turn that ends with "=" is a calculator call on the expression
  before it; an expression that starts with an operator ("+56") goes on from the previous
  call's result. The result is appended and the model goes on. A turn without "=" is the
  final answer, scored by reward.fn on that last turn's text. Turns are bounded by
  rollout.max_turns (the trajectory is then `truncated`).
      12+34+56= | 12+34= | 46 | +56= | 102 | 102<eos>  (the model must learn to chain calls)
"""
from __future__ import annotations

from stages.agentflow.envs import RetryEnv


class RetryAgent:
    max_attempts = 3

    async def run(self, ctx, sample: dict) -> None:
        env = RetryEnv(sample, max_attempts=self.max_attempts)
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
