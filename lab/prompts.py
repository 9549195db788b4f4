"""The prompt mix a drafter for the real target is trained and judged on: code, math and chat,
made from templates so that it is the same on every machine. The held-out prompts use code tasks,
chat topics and numbers the training prompts never use.

    python lab/prompts.py probe   # the held-out prompts, chat-templated, as a playbook lists them
"""

from __future__ import annotations

import json
import random
import sys

CODE_TASKS = [
    "returns the sum of a list",
    "reverses a string",
    "checks if a number is prime",
    "finds the largest number in a list",
    "counts the vowels in a string",
    "sorts a list of numbers",
    "returns the factorial of a number",
    "checks if a string is a palindrome",
    "removes duplicates from a list",
    "returns the nth Fibonacci number",
    "merges two sorted lists",
    "converts Celsius to Fahrenheit",
    "counts the words in a sentence",
    "finds the average of a list",
    "returns the even numbers from a list",
    "checks if two strings are anagrams",
    "flattens a nested list",
    "finds the second largest number in a list",
    "capitalizes every word in a string",
    "returns the length of the longest word",
    "computes the greatest common divisor of two numbers",
    "checks if a year is a leap year",
    "reads a file and counts its lines",
    "returns the square of every number in a list",
    "finds the index of an item in a list",
    "joins a list of strings with commas",
    "converts a list of strings to integers",
    "returns the minimum and maximum of a list",
    "checks if a list is sorted",
    "counts how often each letter appears in a string",
    "returns the sum of the digits of a number",
    "swaps the keys and values of a dictionary",
    "finds common elements of two lists",
    "splits a list into chunks of size n",
    "rotates a list by k positions",
    "converts a number to binary",
    "removes the whitespace from a string",
    "returns the product of a list of numbers",
    "checks if a number is a perfect square",
    "generates the multiplication table of a number",
    "reverses the order of words in a sentence",
    "finds the median of a list",
    "counts the number of uppercase letters in a string",
    "returns a list of prime numbers up to n",
    "checks if a string contains only digits",
    "computes the power of a number without pow",
    "finds the missing number in a list from 1 to n",
    "returns the first non-repeated character",
    # held out from here on (never in training)
    "returns the cumulative sum of a list",
    "checks if a number is even",
    "finds the longest common prefix of a list of strings",
    "converts a string to title case",
    "returns the number of days between two dates",
    "computes the area of a circle",
    "removes the vowels from a string",
    "finds the mode of a list",
]
CODE_FORMS = [
    "Write a Python function that {t}.",
    "Show me Python code that {t}.",
    "How do I write a function in Python that {t}?",
    "Write a short Python program that {t}.",
    "Write a JavaScript function that {t}.",
    "Write a function that {t}, with a docstring.",
    "Can you write a Python function that {t} and explain it?",
    "Implement a function that {t}.",
]
TOPICS = [
    "the moon",
    "cats",
    "the ocean",
    "photosynthesis",
    "the water cycle",
    "volcanoes",
    "honey bees",
    "the solar system",
    "rainbows",
    "dinosaurs",
    "the human heart",
    "trees",
    "the internet",
    "electricity",
    "the seasons",
    "sleep",
    "friendship",
    "music",
    "the desert",
    "penguins",
    "the rain forest",
    "gravity",
    "the pyramids",
    "bicycles",
    "coffee",
    "chess",
    "whales",
    "snow",
    "the brain",
    "recycling",
    "the wind",
    "lighthouses",
    "bread",
    "the stars",
    "mountains",
    "rivers",
    "butterflies",
    "the library",
    "trains",
    "gardening",
    # held out from here on (never in training)
    "owls",
    "the Arctic",
    "kites",
    "thunderstorms",
    "coral reefs",
    "the printing press",
    "hot air balloons",
    "bamboo",
]
CHAT_FORMS = [
    "Tell me about {t}.",
    "Write a short story about {t}.",
    "Explain {t} to a child.",
    "Write a poem about {t}.",
    "What are three facts about {t}?",
    "Why is {t} important?",
    "Describe {t} in a few sentences.",
    "Give me a fun fact about {t}.",
]
MATH_FORMS = [
    "What is {a} plus {b}?",
    "What is {a} times {b}?",
    "What is {a} minus {b}?",
    "If I have {a} apples and eat {b}, how many are left?",
    "Solve for x: {a}x + {b} = {c}.",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "What is {b} percent of {a}?",
    "A shop sells pens for {b} dollars each. How much do {a} pens cost?",
]
HELD_CODE, HELD_TOPICS = 8, 8  # the last ones of each list


def chat(text: str) -> str:
    """SmolLM2-Instruct's chat template with its default system prompt, as a completion prompt."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def _math(rng: random.Random, low: int, high: int) -> str:
    form = rng.choice(MATH_FORMS)
    a, b = rng.randint(low, high), rng.randint(2, 12)
    return form.format(a=a, b=b, c=a * rng.randint(2, 9) + b)


def training(seed: int = 0, math_prompts: int = 1200) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = [{"kind": "code", "text": f.format(t=t)} for t in CODE_TASKS[:-HELD_CODE] for f in CODE_FORMS]
    out += [{"kind": "chat", "text": f.format(t=t)} for t in TOPICS[:-HELD_TOPICS] for f in CHAT_FORMS]
    out += [{"kind": "math", "text": _math(rng, 13, 99)} for _ in range(math_prompts)]
    seen: set[str] = set()
    return [p for p in out if not (p["text"] in seen or seen.add(p["text"]))]  # type: ignore[func-returns-value]


def held_out(per_kind: int = 4, seed: int = 1) -> list[dict[str, str]]:
    """Prompts no training prompt shares a task, topic or number range with: the probe's."""
    rng = random.Random(seed)
    code = [
        {"kind": "code", "text": CODE_FORMS[i % len(CODE_FORMS)].format(t=t)}
        for i, t in enumerate(CODE_TASKS[-HELD_CODE:])
    ]
    chat_ = [
        {"kind": "chat", "text": CHAT_FORMS[i % len(CHAT_FORMS)].format(t=t)}
        for i, t in enumerate(TOPICS[-HELD_TOPICS:])
    ]
    math = [{"kind": "math", "text": _math(rng, 101, 999)} for _ in range(per_kind)]
    return code[:per_kind] + math + chat_[:per_kind]


if __name__ == "__main__":
    if sys.argv[1:] == ["probe"]:
        print(json.dumps([chat(p["text"]) for p in held_out()], indent=2))
    else:
        raise SystemExit(__doc__)
