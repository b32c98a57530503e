"""A black-box multi-turn game agent written with the official `openai` SDK: guess a hidden number.

Run by AgentFlow once per trajectory (`agent.name: "cmd:python examples/agents/guess_number.py"`),
or by hand against any OpenAI-compatible server. Like any third-party agent it only knows
the OpenAI API; the SDK reads where the model is from the environment:

    OPENAI_BASE_URL, OPENAI_API_KEY   this trajectory's proxy endpoint (set by AgentFlow)
    LOONGSAGE_SAMPLE                  optional task row as JSON; its `seed` or `prompt` picks the
                                      hidden number, so a group's samples play the same game

The game: a hidden number in [0, --max]; each turn the model answers with a guess and the
game replies whether the number is higher or lower, in the same conversation, for up to
--turns guesses. The game is the environment, in this process, and runs nothing the model
writes: its report (last stdout line, JSON) states the reward, graded by reward.fn `agent_reported`:
1 for a right guess on the first turn, halved for each turn after; 0 if never found; with the
target, the guesses and the feedback.

Messages are spelled in --words (plain English, for real models) or, by default, in the
alphabet of the built-in tiny model (digits, "+" and "="), whose character tokenizer can
spell nothing else:

    opening "="      "your guess?"
    "+"              the number is higher than your guess
    "="              the number is lower than your guess

The tiny model is not warmed on this game, so it is a protocol example and test (a real
subprocess, the real SDK, multi-turn through the recording proxy), not a recipe that
trains in minutes; configs/agent_blackbox.yaml trains examples/agents/addition.py.

Try it:
    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x \\
    python examples/agents/guess_number.py --words --max 100 --turns 7
"""
import argparse
import hashlib
import json
import os
import re
import sys

import openai

TINY = {"open": "=", "higher": "+", "lower": "="}
WORDS = {"open": "I picked a whole number from 0 to {max}. Guess it: reply with the number only.",
         "higher": "Higher.", "lower": "Lower."}


def hidden_number(sample: dict, top: int) -> int:
    key = str(sample.get("seed", sample.get("prompt", "")))
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % (top + 1)


def main() -> None:
    p = argparse.ArgumentParser(description="guess-the-number game agent (OpenAI SDK)")
    p.add_argument("--max", type=int, default=99, help="hidden number is in [0, max] (default 99)")
    p.add_argument("--turns", type=int, default=3, help="guesses allowed (default 3)")
    p.add_argument("--max-tokens", type=int, default=4, help="max_tokens per model call (default 4)")
    p.add_argument("--words", action="store_true", help="English messages (for real models)")
    args = p.parse_args()
    if args.max < 0 or args.turns < 1:
        sys.exit("--max must be >= 0 and --turns >= 1")
    try:
        sample = json.loads(os.environ.get("LOONGSAGE_SAMPLE") or "{}")
    except ValueError as e:
        sys.exit(f"LOONGSAGE_SAMPLE is not JSON: {e}")
    text = WORDS if args.words else TINY
    target = hidden_number(sample, args.max)

    client = openai.OpenAI(max_retries=0, timeout=60)   # OPENAI_BASE_URL / OPENAI_API_KEY from the env
    messages = [{"role": "user", "content": text["open"].format(max=args.max)}]
    guesses, feedback, reward = [], [], 0.0
    for turn in range(args.turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=args.max_tokens)
        except openai.APIError as e:   # the proxy's error body says what was wrong
            sys.exit(f"model call failed: {e}")
        content = reply.choices[0].message.content or ""
        guesses.append(content)
        messages.append({"role": "assistant", "content": content})
        found = re.search(r"\d+", content)
        guess = int(found.group()) if found else None
        if guess == target:
            reward = 0.5 ** turn
            break
        word = "higher" if guess is None or guess < target else "lower"
        feedback.append(word)
        if turn + 1 < args.turns:
            messages.append({"role": "user", "content": text[word]})
    print(json.dumps({"reward": reward, "target": target, "guesses": guesses, "feedback": feedback}))


if __name__ == "__main__":
    main()
