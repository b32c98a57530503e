"""A black-box agent for the built-in addition task, in plain Python (urllib, no SDK).

Run by AgentFlow once per trajectory (`rollout.agent: "cmd:python examples/agents/addition.py"`).
It only knows the OpenAI chat API, the way any third-party agent would:

    OPENAI_BASE_URL, OPENAI_API_KEY   where the model is (this trajectory's proxy endpoint)
    LOONGSAGE_SAMPLE                  the task row as JSON: prompt ("37+48="), answer ("85")

It asks the question and reports its reward on the last stdout line: 1 if the answer is
right, else 0. With `--tries 2` a wrong answer is followed by the question again, in the
same conversation (the only feedback the tiny model can read), and a right second answer
earns 0.5. One advantage covers the whole trajectory, so that 0.5 also reinforces the
wrong first answer: the recipe trains with one try; two tries exercise multi-turn
recording (tests/test_agentflow.py).

Try it by hand against any OpenAI-compatible server:
    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x \
    LOONGSAGE_SAMPLE='{"prompt": "37+48=", "answer": "85"}' python examples/agents/addition.py
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
    sample = json.loads(os.environ["LOONGSAGE_SAMPLE"])
    question, answer = sample["prompt"], sample["answer"].strip()
    messages = [{"role": "user", "content": question}]
    reward, tries = 0.0, []
    for value in (1.0, 0.5)[: args.tries]:
        reply = chat(messages)
        tries.append(reply)
        if reply.strip() == answer:
            reward = value
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    print(json.dumps({"reward": reward, "info": {"tries": tries}}))


if __name__ == "__main__":
    main()
