"""A tool-using agent on the official `openai` SDK's Responses API, the way Codex runs.

Run by AgentFlow once per trajectory (`agent.name: "cmd:python examples/agents/responses_tools.py"`),
or by hand against any server with `POST /v1/responses`. Like any third-party harness it
only knows that API; the SDK reads where the model is from the environment:

    OPENAI_BASE_URL, OPENAI_API_KEY   this trajectory's proxy endpoint (set by AgentFlow)
    LOONGSAGE_SAMPLE                  the task row as JSON: prompt ("37+48="); never its answer

The loop, as a coding harness runs it (stateless, as Codex does with store=false: every
call sends the whole history as input items):

    input = [task]
    call the model (streamed, with the `calculator` function tool)
      function_call items -> run each tool here -> function_call_output items -> call again   (--max-steps)
      a message            -> an answer; the question again after it                     (--tries)
    before each call: history over --context-chars -> compact it (below)

Compaction is the agent's own, as Codex and Claude Code do it when their context fills: one
model call with the header `x-loongsage-request-kind: compaction` asks for a summary of the
history, and the conversation goes on from [task, summary, resume] (the summary as the
assistant's own message). The proxy records that call as a compaction segment and the calls
after it as a new segment whose prefix holds the summary. With --verify, a subagent (header
kind `subagent`, `x-loongsage-agent-id: verifier`) answers the task in a fresh conversation
of its own; an answer it disagrees with is reported as not accepted.

Report (last stdout line, JSON): its answers in order, whether each was accepted, its tool calls
and compactions. The recipe's reward.fn, `agent_answers`, grades it: 1 for the right answer on the
first try, 0.5 on the second, 0.25 on the third; 0 if never.

Messages are spelled in --words (plain English, for real models) or, by default, in the
alphabet of the built-in tiny model (digits, "+" and "="), whose character tokenizer can
spell nothing else: the task is the prompt itself, a further try is the question
again, and the compaction request is "=". The tiny model writes no tool calls
(its vocabulary cannot spell the `<tool_call>` markup), so under it the agent answers
directly; anything the model writes that is not a well-formed tool call is just text.

Try it:
    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x \\
    LOONGSAGE_SAMPLE='{"prompt": "37+48="}' \\
    python examples/agents/responses_tools.py --words --max-tokens 256
"""
import argparse
import ast
import json
import operator
import os
import sys

import openai

KIND = "x-loongsage-request-kind"       # main | compaction | subagent (stages/agentflow/session.py)
AGENT = "x-loongsage-agent-id"

TOOLS = [{"type": "function", "name": "calculator", "strict": False,
          "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}]

TINY = {"system": "", "task": "{prompt}", "retry": "{prompt}", "compact": "=", "resume": "{prompt}"}
WORDS = {"system": "You solve arithmetic. Use the calculator tool when it helps. "
                   "Your final reply is the number only.",
         "task": "Compute {question}.",
         "retry": "That is not right. Compute {question} again; reply with the number only.",
         "compact": "Your context is full. Summarise the conversation so far in a few lines: the task, what "
                    "you tried and what you found. The summary replaces the conversation.",
         "resume": "Continue from your summary above: compute {question}; reply with the number only."}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """+ - * / and parentheses on numbers; anything else is a ValueError."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")

    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    value = ev(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def run_tool(item) -> dict:
    """One function_call item -> its function_call_output item; a bad call gets an error the model reads."""
    try:
        if item.name != "calculator":
            raise ValueError(f"unknown tool {item.name!r} (tools: calculator)")
        args = json.loads(item.arguments or "{}")
        output = calculator(args.get("expression") if isinstance(args, dict) else None)
    except (ValueError, SyntaxError, TypeError, ZeroDivisionError) as e:   # json's errors are ValueErrors
        output = f"error: {e}"
    return {"type": "function_call_output", "call_id": item.call_id, "output": output}


def chars(items: list[dict]) -> int:
    """History size as the context limit counts it: the characters of its texts, tool calls and outputs."""
    def size(item: dict) -> int:
        content = item.get("content")
        text = content if isinstance(content, str) else "".join(p.get("text") or "" for p in content or [])
        return len(text) + len(item.get("arguments") or "") + len(item.get("output") or "")
    return sum(size(i) for i in items)


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


class Harness:
    def __init__(self, args, text: dict, sample: dict):
        self.args = args
        self.client = openai.OpenAI(max_retries=0, timeout=60)    # OPENAI_BASE_URL / OPENAI_API_KEY from the env
        prompt = sample["prompt"]
        fill = {"prompt": prompt, "question": prompt.rstrip("=").strip()}
        self.say = {k: v.format(**fill) for k, v in text.items()}
        self.tool_calls = self.compactions = 0
        self.kept = 1           # items the last compaction left (the task at the start): only growth is compacted

    def call(self, items: list[dict], kind: str = "main", agent: str = "", tools: bool = True):
        """One model call, streamed (or not, --no-stream); the request kind travels as a header."""
        headers = {KIND: kind} | ({AGENT: agent} if agent else {})
        kw = {"model": self.args.model, "input": items, "max_output_tokens": self.args.max_tokens,
              "store": False, "extra_headers": headers}
        if self.say["system"]:
            kw["instructions"] = self.say["system"]
        if tools:
            kw["tools"] = TOOLS
        try:
            if self.args.no_stream:
                return self.client.responses.create(**kw)
            final = None
            for event in self.client.responses.create(stream=True, **kw):
                if event.type in ("response.completed", "response.incomplete"):
                    final = event.response
                elif event.type in ("response.failed", "error"):
                    sys.exit(f"model call failed ({kind}): {event}")
        except openai.APIError as e:     # the proxy's error body says what was wrong
            sys.exit(f"model call failed ({kind}): {e}")
        if final is None:
            sys.exit(f"model call failed ({kind}): the stream ended without response.completed")
        return final

    def compact(self, items: list[dict]) -> list[dict]:
        """Replace the history by [task, summary, resume]: the summary is the model's own."""
        summary = self.call(items + [user(self.say["compact"])], kind="compaction", tools=False).output_text
        self.compactions += 1
        history = [user(self.say["task"]), assistant(summary), user(self.say["resume"])]
        self.kept = len(history)    # compacting it again would not shrink it
        return history

    def solve(self, items: list[dict]) -> tuple[str, list[dict]]:
        """Tool loop until the model answers with a message only (or --max-steps calls): (answer, history)."""
        for _ in range(self.args.max_steps):
            if chars(items) > self.args.context_chars and len(items) > self.kept:
                items = self.compact(items)
            reply = self.call(items)
            calls = [o for o in reply.output if o.type == "function_call"]
            items = items + [_item(o) for o in reply.output]
            if not calls:
                return reply.output_text.strip(), items
            self.tool_calls += len(calls)
            items += [run_tool(c) for c in calls]
        return "", items

    def verified(self, answer: str) -> bool:
        """A subagent answers the task in a conversation of its own; a disagreement rejects the answer."""
        return self.call([user(self.say["task"])], kind="subagent", agent="verifier").output_text.strip() == answer


def _item(o) -> dict:
    """An output item as the next request sends it back (messages, function calls; reasoning kept whole)."""
    if o.type == "message":
        return assistant("".join(p.text for p in o.content if p.type == "output_text"))
    if o.type == "function_call":
        return {"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments}
    return o.model_dump(exclude_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description="tool-using agent on the openai SDK's Responses API")
    p.add_argument("--tries", type=int, default=1, choices=(1, 2, 3), help="answers allowed (default 1)")
    p.add_argument("--max-steps", type=int, default=4, help="model calls per try, tool calls included (default 4)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_output_tokens per call (default 8)")
    p.add_argument("--context-chars", type=int, default=int(os.environ.get("LOONGSAGE_CONTEXT_CHARS", 12000)),
                   help="compact the history past this many characters (default $LOONGSAGE_CONTEXT_CHARS or 12000)")
    p.add_argument("--verify", action="store_true", help="a subagent checks each answer")
    p.add_argument("--no-stream", action="store_true", help="plain calls instead of streamed ones")
    p.add_argument("--model", default="policy")
    p.add_argument("--words", action="store_true", help="English messages (for real models)")
    args = p.parse_args()
    if args.max_steps < 1 or args.max_tokens < 1 or args.context_chars < 1:
        sys.exit("--max-steps, --max-tokens and --context-chars must be >= 1")
    try:
        sample = json.loads(os.environ["LOONGSAGE_SAMPLE"])
        sample["prompt"]
    except (KeyError, ValueError) as e:
        sys.exit(f"LOONGSAGE_SAMPLE must be a JSON row with a prompt: {e!r}")
    agent = Harness(args, WORDS if args.words else TINY, sample)
    items, answers, accepted = [user(agent.say["task"])], [], []
    for i in range(args.tries):
        if i:
            items.append(user(agent.say["retry"]))
        got, items = agent.solve(items)
        answers.append(got)
        accepted.append(not args.verify or agent.verified(got))   # what its verifier agrees with
    print(json.dumps({"answers": answers, "accepted": accepted, "tool_calls": agent.tool_calls,
                      "compactions": agent.compactions}))


if __name__ == "__main__":
    main()
