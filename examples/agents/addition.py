"""A black-box agent for the built-in addition task, in plain Python (urllib, no SDK).

Run by AgentFlow once per trajectory (`agent.name: "cmd:python examples/agents/addition.py"`).
It only knows the OpenAI chat API, the way any third-party agent would:

    OPENAI_BASE_URL, OPENAI_API_KEY   where the model is (this trajectory's proxy endpoint)
    LOONGSAGE_SAMPLE                  the task row as JSON: prompt ("37+48="); never its answer

It asks the question and reports its answers on the last stdout line ({"answers": [...]});
the recipe's reward.fn, `agent_answers`, grades them: 1 if the first is right, 0.5 if only the
second is. With `--tries 2` the question is asked again after the first answer, in the same
conversation (the only prompt the tiny model can read). One advantage covers the whole
trajectory: the recipe trains with one try; two tries exercise multi-turn recording
(tests/test_agentflow.py).

Try it by hand against any OpenAI-compatible server:
    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x \
    LOONGSAGE_SAMPLE='{"prompt": "37+48="}' python examples/agents/addition.py
"""
import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def chat(messages: list[dict]) -> str:
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "max_tokens": 8}).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)["choices"][0]["message"]["content"] or ""
    except urllib.error.HTTPError as e:  # the proxy's error body says what was wrong
        sys.exit(f"model call failed: HTTP {e.code}: {e.read().decode(errors='replace')}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tries", type=int, default=1, choices=(1, 2))
    args = p.parse_args()
    question = json.loads(os.environ["LOONGSAGE_SAMPLE"])["prompt"]
    messages, answers = [{"role": "user", "content": question}], []
    for _ in range(args.tries):
        reply = chat(messages)
        answers.append(reply.strip())
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    print(json.dumps({"answers": answers}))


if __name__ == "__main__":
    main()
