"""A tool-using agent on the official `anthropic` SDK (Messages API), the way Claude Code runs.

Run by AgentFlow once per trajectory (`agent.name: "cmd:python examples/agents/anthropic_tools.py"`),
or by hand against any Anthropic-compatible server. Like any third-party harness it only
knows the Messages API; the SDK reads where the model is from the environment:

    ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY   this trajectory's proxy endpoint (set by AgentFlow)
    LOONGSAGE_SAMPLE                        the task row as JSON: prompt ("37+48="); never its answer

The loop, as a coding harness runs it:

    messages = [task]
    call the model (streamed, with the `calculator` tool)
      tool_use blocks  -> run each tool here -> tool_result blocks -> call again   (--max-steps)
      text, end_turn   -> an answer; the question again after it            (--tries)
    before each call: history over --context-chars -> compact it (below)

Compaction is the agent's own, as Claude Code and Codex do it when their context fills: one
model call with the header `x-loongsage-request-kind: compaction` asks for a summary of the
history, and the conversation goes on from [task, summary, resume] (the summary as the
agent's own turn). The proxy records that call as a compaction segment and the calls after
it as a new segment whose prefix holds the summary. With --verify, a subagent (header kind
`subagent`, `x-loongsage-agent-id: verifier`) answers the task in a fresh conversation of
its own; an answer it disagrees with is reported as not accepted.

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
    ANTHROPIC_BASE_URL=http://localhost:8000 ANTHROPIC_API_KEY=x \\
    LOONGSAGE_SAMPLE='{"prompt": "37+48="}' \\
    python examples/agents/anthropic_tools.py --words --max-tokens 256
"""
import argparse
import ast
import json
import operator
import os
import sys

import anthropic

KIND = "x-loongsage-request-kind"       # main | compaction | subagent (stages/agentflow/session.py)
AGENT = "x-loongsage-agent-id"

TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
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


def run_tool(block) -> dict:
    """One tool_use block -> its tool_result block; a bad call gets an error result the model reads."""
    try:
        if block.name != "calculator":
            raise ValueError(f"unknown tool {block.name!r} (tools: calculator)")
        args = block.input if isinstance(block.input, dict) else {}
        return {"type": "tool_result", "tool_use_id": block.id, "content": calculator(args.get("expression"))}
    except (ValueError, SyntaxError, TypeError, ZeroDivisionError) as e:
        return {"type": "tool_result", "tool_use_id": block.id, "content": f"error: {e}", "is_error": True}


def chars(messages: list[dict]) -> int:
    """History size as the context limit counts it: the characters of its texts, tool inputs and results."""
    def size(content) -> int:
        if isinstance(content, str):
            return len(content)
        return sum(len(b.get("text") or "") + size(b.get("content") or "") + (len(json.dumps(b["input"]))
                   if "input" in b else 0) for b in content)
    return sum(size(m["content"]) for m in messages)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


class Harness:
    def __init__(self, args, text: dict, sample: dict):
        self.args, self.text = args, text
        self.client = anthropic.Anthropic(max_retries=0, timeout=60)  # ANTHROPIC_BASE_URL / _API_KEY from the env
        prompt = sample["prompt"]
        fill = {"prompt": prompt, "question": prompt.rstrip("=").strip()}
        self.say = {k: v.format(**fill) for k, v in text.items()}
        self.tool_calls = self.compactions = 0
        self.kept = 1           # messages the last compaction left (the task at the start): only growth is compacted

    def call(self, messages: list[dict], kind: str = "main", agent: str = "", tools: bool = True):
        """One model call, streamed (or not, --no-stream); the request kind travels as a header."""
        headers = {KIND: kind} | ({AGENT: agent} if agent else {})
        kw = {"model": self.args.model, "max_tokens": self.args.max_tokens, "messages": messages,
              "extra_headers": headers}
        if self.say["system"]:
            kw["system"] = self.say["system"]
        if tools:
            kw["tools"] = TOOLS
        try:
            if self.args.no_stream:
                return self.client.messages.create(**kw)
            with self.client.messages.stream(**kw) as stream:
                return stream.get_final_message()
        except anthropic.APIError as e:     # the proxy's error body says what was wrong
            sys.exit(f"model call failed ({kind}): {e}")

    def compact(self, messages: list[dict]) -> list[dict]:
        """Replace the history by [task, summary, resume]: the summary is the model's own."""
        ask = [*messages[:-1], _with_text(messages[-1], self.say["compact"])]
        summary = text_of(self.call(ask, kind="compaction", tools=False))
        self.compactions += 1
        history = [{"role": "user", "content": self.say["task"]}, {"role": "assistant", "content": summary},
                   {"role": "user", "content": self.say["resume"]}]
        self.kept = len(history)    # compacting it again would not shrink it
        return history

    def solve(self, messages: list[dict]) -> tuple[str, list[dict]]:
        """Tool loop until the model ends its turn with text (or --max-steps calls): (answer, history)."""
        for _ in range(self.args.max_steps):
            if chars(messages) > self.args.context_chars and len(messages) > self.kept:
                messages = self.compact(messages)
            reply = self.call(messages)
            uses = [b for b in reply.content if b.type == "tool_use"]
            messages = messages + [{"role": "assistant", "content": [_block(b) for b in reply.content]}]
            if not uses:
                return text_of(reply).strip(), messages
            self.tool_calls += len(uses)
            messages.append({"role": "user", "content": [run_tool(b) for b in uses]})
        return "", messages

    def verified(self, answer: str) -> bool:
        """A subagent answers the task in a conversation of its own; a disagreement rejects the answer."""
        reply = self.call([{"role": "user", "content": self.say["task"]}], kind="subagent", agent="verifier")
        return text_of(reply).strip() == answer


def _block(b) -> dict:
    """A reply's content block as the next request sends it back (text and tool_use; thinking kept whole)."""
    if b.type == "text":
        return {"type": "text", "text": b.text}
    if b.type == "tool_use":
        return {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
    return b.model_dump(exclude_none=True)


def _with_text(message: dict, text: str) -> dict:
    """A user message with one more text block (the compaction request joins the last user turn)."""
    content = message["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    return {"role": message["role"], "content": blocks + [{"type": "text", "text": text}]}


def main() -> None:
    p = argparse.ArgumentParser(description="tool-using agent on the anthropic SDK (Messages API)")
    p.add_argument("--tries", type=int, default=1, choices=(1, 2, 3), help="answers allowed (default 1)")
    p.add_argument("--max-steps", type=int, default=4, help="model calls per try, tool calls included (default 4)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per call (default 8)")
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
    messages, answers, accepted = [{"role": "user", "content": agent.say["task"]}], [], []
    for i in range(args.tries):
        if i:
            messages.append({"role": "user", "content": agent.say["retry"]})
        got, messages = agent.solve(messages)
        answers.append(got)
        accepted.append(not args.verify or agent.verified(got))   # what its verifier agrees with
    print(json.dumps({"answers": answers, "accepted": accepted, "tool_calls": agent.tool_calls,
                      "compactions": agent.compactions}))


if __name__ == "__main__":
    main()
