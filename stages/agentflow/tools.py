"""Tools for white-box agents: a small registry and the built-in calculator.

A tool is a name, an OpenAI-style JSON-schema description and a function of keyword arguments returning text
(`async def` works too). A white-box agent calls `await ctx.call_tool(name, args)`; the result text joins the
trajectory as loss_mask=0 tokens. A failure (unknown name, bad arguments, an exception, a timeout) comes back as an
"error: ..." result the model can read, never as a crashed trajectory: a model learning tools must see its mistakes.
"""
from __future__ import annotations

import ast
import asyncio
import json
import operator
from dataclasses import dataclass
from typing import Callable


class ToolFatalError(Exception):
    """Raised by a tool whose failure should fail the trajectory instead of being an observation
    (e.g. a remote tool service with on_error=fail): the registry lets it through."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict          # JSON schema of the keyword arguments
    fn: Callable[..., object]


class ToolRegistry:
    def __init__(self, tools: tuple[Tool, ...] | list[Tool] = (), timeout_s: float = 10.0):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s

    def register(self, tool: Tool) -> None:
        self.tools[tool.name] = tool

    async def call(self, name: str, args: dict | str | None = None) -> str:
        tool = self.tools.get(name)
        if tool is None:
            return f"error: unknown tool {name!r} (tools: {', '.join(self.tools) or 'none'})"
        try:
            kwargs = json.loads(args) if isinstance(args, str) else dict(args or {})
            res = tool.fn(**kwargs)
            if asyncio.iscoroutine(res):
                res = await asyncio.wait_for(res, self.timeout_s)
            return str(res)
        except asyncio.TimeoutError:
            return f"error: tool {name} timed out after {self.timeout_s}s"
        except ToolFatalError:
            raise
        except Exception as e:  # noqa: BLE001 - the model reads the error instead of the run failing
            return f"error: {type(e).__name__}: {e}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate + - * / // % and parentheses on numbers; nothing else parses (no names, no calls)."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = ev(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


BUILTIN_TOOLS = (Tool(
    name="calculator", description="Evaluate an arithmetic expression (+ - * / and parentheses).",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    fn=calculate,
),)
