"""A minimal OpenAI Agents SDK agent with one function tool: what the harness tier runs as `Agents SDK`.

Reads OPENAI_BASE_URL / OPENAI_API_KEY like any SDK program, runs TASK (argv[1]) with the default
Responses model, prints the final output. Tracing is off (it would upload to OpenAI)."""
import subprocess
import sys

from agents import Agent, Runner, function_tool, set_tracing_disabled


@function_tool
def run_shell(command: str) -> str:
    """Run a shell command and return its standard output."""
    return subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30).stdout


def main() -> None:
    set_tracing_disabled(True)
    agent = Agent(name="shell", instructions="Use run_shell to run commands, then answer.", tools=[run_shell],
                  model="loongsage")
    print(Runner.run_sync(agent, sys.argv[1], max_turns=4).final_output)


if __name__ == "__main__":
    main()
