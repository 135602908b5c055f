"""Three kinds of LLM program, side by side, on the default model (SmolLM2-135M-Instruct, CPU, greedy):

  select  a few-shot classifier: a shared ~350-token preamble, one short text, then a 4-way select; a batch.
  tree    a tree of thought: a question forks into branches that each write a thought and judge it (select);
          the parent joins them and writes a final answer from the approved thoughts.
  chat    multi-turn chat: a system prompt, then user turns each answered by an assistant gen.

Each kind runs on three sides with the same text, token budgets and greedy decoding:

  F  furcate's language (`@sgl.function`, fork, select, roles) via run_batch on Engine("default") (radix cache on)
  a  the same programs as plain sequential Engine.generate calls, one call at a time, radix cache off; a select
     is one max_new_tokens=0 call per choice, scored by mean choice-token logprob in Python
  b  the same programs in guidance 0.3.1 on HF transformers (same weights), run sequentially as its users do

Prints wall seconds, programs/s, speedups (time_a / time_F, time_b / time_F) and furcate's cache hit rate,
and writes benchmarks/results/programs.{json,md}. Needs the bench extra: pip install -e '.[bench]'.

    python -m benchmarks.programs [--quick] [--kinds select,tree,chat] [--sides F,a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import time
import warnings

import furcate as sgl
from furcate.runtime.model.weights.default_model import prepare_default_model

RESULTS = pathlib.Path(__file__).parent / "results"
LABELS = [" sports", " politics", " technology", " food"]
VERDICTS = [" yes", " no"]
EXAMPLES = [
    ("The striker scored twice in the second half to win the cup final.", "sports"),
    ("Parliament passed the new budget after a long night of debate.", "politics"),
    ("The company released a phone with a faster chip and a better camera.", "technology"),
    ("Slow-roast the lamb with garlic and rosemary for three hours.", "food"),
    ("The marathon runner broke the course record by forty seconds.", "sports"),
    ("The senator announced she will run for governor next year.", "politics"),
    ("A new open-source database promises ten times faster queries.", "technology"),
    ("This bakery's sourdough has a crisp crust and an airy crumb.", "food"),
    ("The tennis champion retired after twenty years on the tour.", "sports"),
    ("Voters in the city rejected the proposed tax increase.", "politics"),
    ("Engineers tested a battery that charges in five minutes.", "technology"),
    ("Add a pinch of salt to the caramel before it cools.", "food"),
    ("The home team lost in overtime after a missed penalty.", "sports"),
    ("The minister resigned over the leaked emails.", "politics"),
    ("The update fixes a security flaw in the browser's sandbox.", "technology"),
    ("Fresh basil, tomatoes and mozzarella make a perfect summer salad.", "food"),
]
PREAMBLE = ("Classify each text into exactly one topic: sports, politics, technology or food. Answer with the "
            "topic only.\n\n" + "".join(f"Text: {t}\nTopic: {label}\n\n" for t, label in EXAMPLES))
SUBJECTS = ["the goalkeeper", "the prime minister", "the new laptop", "the soup", "the coach", "the election",
            "the smartphone app", "the chocolate cake"]
EVENTS = ["surprised everyone this week", "was discussed on the evening news", "got mixed reviews",
          "made headlines again"]
QUESTIONS = ["How can a small town reduce traffic jams?", "Why do leaves change colour in autumn?",
             "How should a student prepare for a maths exam?", "What makes a good team leader?",
             "How can a family save money on groceries?", "Why is sleep important for memory?",
             "How could a city make its streets safer for cyclists?", "What is the best way to learn a language?",
             "How can a library attract more young readers?", "Why do some bridges sway in the wind?"]
TREE_PREAMBLE = ("You are a careful problem solver. For the question, write one thought from each angle, judge "
                 "whether it is useful, then answer in one sentence.\n\n"
                 "Question: How can I keep my coffee warm longer?\n"
                 "Thought (cost): A cheap insulated mug with a lid keeps coffee hot for about an hour longer than a "
                 "cup.\nIs this thought useful? Answer: yes\n"
                 "Thought (people): My friends like tea more than coffee, and they drink it in the garden.\n"
                 "Is this thought useful? Answer: no\n"
                 "Useful thoughts: A cheap insulated mug with a lid keeps coffee hot for about an hour longer than a "
                 "cup.\nAnswer: Pour it into an insulated mug with a lid.\n\n")
ANGLES = ["cost", "people", "time", "risks", "tools", "habits", "science", "place"]  # one per branch
JUDGE = "\nIs this thought useful? Answer:"
SYSTEM = "You are a friendly assistant. Keep every answer short and practical."
TOPICS = ["a weekend trip to the mountains", "starting a vegetable garden", "learning to play the guitar",
          "training for a first 10k run", "cooking dinner for eight guests", "choosing a used car",
          "keeping a houseplant alive", "organising a book club", "painting a bedroom", "adopting a cat"]
FOLLOW_UPS = ["Can you give me one more tip?", "What is the most common mistake?", "How long will it take?",
              "What should I buy first?"]


# -- workloads: one argument dict per program -----------------------------------------------------------------

def select_items(n: int) -> list[dict]:
    return [{"text": f"{SUBJECTS[i % len(SUBJECTS)].capitalize()} {EVENTS[(i // len(SUBJECTS)) % len(EVENTS)]}"
                     f" (report {i + 1})."} for i in range(n)]


def tree_items(n: int) -> list[dict]:
    return [{"question": QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (case {i + 1})")}
            for i in range(n)]


def chat_items(n: int, turns: int) -> list[dict]:
    return [{"turns": [f"I need help with {TOPICS[i % len(TOPICS)]}. Where do I start?"]
             + [FOLLOW_UPS[(i + t) % len(FOLLOW_UPS)] for t in range(turns - 1)]} for i in range(n)]


def warmup_items(items: list[dict]) -> list[dict]:
    """Two untimed programs per kind and side, so one-time costs (first forwards of each shape and path, first
    logprob call) are not timed; their texts differ from the timed ones."""
    def mark(value):
        return "Warm-up. " + value if isinstance(value, str) else ["Warm-up. " + value[0], *value[1:]]
    return [{key: mark(value) for key, value in item.items()} for item in items[:2]]


def thought_cue(branch: int) -> str:
    return f"Thought ({ANGLES[branch % len(ANGLES)]}):"


def summary(thoughts: list[str], verdicts: list[str]) -> str:
    """What the parent adds after the join: the thoughts judged useful, then the answer cue."""
    kept = [t.strip() for t, v in zip(thoughts, verdicts) if v == " yes"] or ["(none)"]
    return "Useful thoughts: " + " | ".join(kept) + "\nAnswer:"


# -- F: furcate's language ------------------------------------------------------------------------------------

def furcate_programs(cfg: argparse.Namespace) -> dict:
    @sgl.function
    def classify(s, text):
        s += PREAMBLE + "Text: " + text + "\nTopic:" + sgl.select("label", choices=LABELS)

    @sgl.function
    def tree(s, question):
        s += TREE_PREAMBLE + "Question: " + question + "\n"
        forks = s.fork(cfg.branches)
        thought = sgl.gen("thought", max_tokens=cfg.thought_tokens, stop="\n", temperature=0)
        forks += lambda i: thought_cue(i) + thought
        forks += JUDGE + sgl.select("verdict", choices=VERDICTS)
        forks.join()
        s += summary(s["thought"], s["verdict"]) + sgl.gen("answer", max_tokens=cfg.answer_tokens, stop="\n",
                                                           temperature=0)

    @sgl.function
    def chat(s, turns):
        s += sgl.system(SYSTEM)
        for t, message in enumerate(turns):
            s += sgl.user(message)
            s += sgl.assistant(sgl.gen(f"reply{t}", max_tokens=cfg.reply_tokens, temperature=0))

    return {"select": classify, "tree": tree, "chat": chat}


def furcate_outputs(kind: str, state, cfg) -> dict:
    if kind == "select":
        return {"label": state["label"]}
    if kind == "tree":
        return {"thought": state["thought"], "verdict": state["verdict"], "answer": state["answer"]}
    return {"replies": [state[f"reply{t}"] for t in range(cfg.chat_turns)]}


def run_furcate(cfg, workloads: dict) -> dict:
    results = {}
    programs = furcate_programs(cfg)
    with sgl.Engine("default", torch_num_threads=cfg.threads) as engine:
        for kind, items in workloads.items():
            programs[kind].run_batch(warmup_items(items), backend=engine)
            assert engine.flush_cache(), "furcate refused to flush its prefix cache"
            before = engine.get_stats()
            started = time.perf_counter()
            # Every gen sets temperature=0 itself (select is greedy by default), as on the other two sides.
            states = programs[kind].run_batch(items, backend=engine)
            outputs = [furcate_outputs(kind, state, cfg) for state in states]
            wall = time.perf_counter() - started
            after = engine.get_stats()
            prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
            cached = after["cached_tokens_total"] - before["cached_tokens_total"]
            results[kind] = {"wall_seconds": wall, "programs_per_s": len(items) / wall, "prompt_tokens": prompt,
                             "cached_tokens": cached, "cache_hit_rate": cached / prompt if prompt else 0.0,
                             "outputs": outputs}
    return results


# -- a: plain sequential Engine.generate calls ----------------------------------------------------------------

class PlainCalls:
    """One engine.generate call at a time, each with the full prompt text."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def gen(self, prompt: str, max_tokens: int, stop: str | None = None) -> str:
        params = {"max_new_tokens": max_tokens, "temperature": 0, "stop": stop}
        return self.engine.generate(prompt, params)["text"]

    def select(self, prompt: str, choices: list[str]) -> str:
        prompt_ids = self.tokenizer.encode(prompt)
        scores = []
        for choice in choices:
            ids = self.tokenizer.encode(prompt + choice)
            start = next((i for i, (x, y) in enumerate(zip(prompt_ids, ids)) if x != y), len(prompt_ids))
            start = min(start, len(ids) - 1)  # a token merging the prompt's end and the choice counts as choice
            out = self.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                       logprob_start_len=start)
            logprobs = [entry[0] for entry in out["meta_info"]["input_token_logprobs"] if entry[0] is not None]
            scores.append(sum(logprobs) / len(logprobs))
        return choices[max(range(len(choices)), key=lambda i: (scores[i], -i))]

    def chat_prompt(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def plain_program(kind: str, calls: PlainCalls, cfg, item: dict) -> dict:
    if kind == "select":
        return {"label": calls.select(PREAMBLE + "Text: " + item["text"] + "\nTopic:", LABELS)}
    if kind == "tree":
        prefix = TREE_PREAMBLE + "Question: " + item["question"] + "\n"
        thoughts, verdicts = [], []
        for i in range(cfg.branches):
            text = prefix + thought_cue(i)
            thoughts.append(calls.gen(text, cfg.thought_tokens, stop="\n"))
            verdicts.append(calls.select(text + thoughts[-1] + JUDGE, VERDICTS))
        answer = calls.gen(prefix + summary(thoughts, verdicts), cfg.answer_tokens, stop="\n")
        return {"thought": thoughts, "verdict": verdicts, "answer": answer}
    messages, replies = [{"role": "system", "content": SYSTEM}], []
    for message in item["turns"]:
        messages.append({"role": "user", "content": message})
        replies.append(calls.gen(calls.chat_prompt(messages), cfg.reply_tokens))
        messages.append({"role": "assistant", "content": replies[-1]})
    return {"replies": replies}


def run_plain(cfg, workloads: dict) -> dict:
    results = {}
    with sgl.Engine("default", torch_num_threads=cfg.threads, disable_radix_cache=True) as engine:
        calls = PlainCalls(engine)
        for kind, items in workloads.items():
            for item in warmup_items(items):
                plain_program(kind, calls, cfg, item)
            started = time.perf_counter()
            outputs = [plain_program(kind, calls, cfg, item) for item in items]
            wall = time.perf_counter() - started
            results[kind] = {"wall_seconds": wall, "programs_per_s": len(items) / wall, "outputs": outputs}
    return results


# -- b: guidance on HF transformers ---------------------------------------------------------------------------

@contextlib.contextmanager
def legacy_cache_crop():
    """ADAPTER for guidance 0.3.1 on transformers 5.x: guidance calls `past_key_values.crop(n)` meaning "keep the
    first n tokens" (transformers 4.x semantics), but 5.x's Cache.crop takes the number of tokens to remove, as a
    negative int, and raises on a positive one. While guidance runs, a non-negative n is translated to
    crop(-(seq_len - n)); n == 0 (keep nothing, which 5.x would treat as a no-op) is translated too."""
    from transformers.cache_utils import Cache

    original = Cache.crop

    def crop(self, n: int) -> None:
        if n >= 0:  # legacy "keep n": remove the rest
            n = min(0, n - self.get_seq_length())
            if n == 0:
                return
        original(self, n)

    Cache.crop = crop
    try:
        yield
    finally:
        Cache.crop = original


def guidance_program(kind: str, lm, cfg, item: dict) -> dict:
    from guidance import assistant, gen, select, system, user

    if kind == "select":
        out = lm + PREAMBLE + "Text: " + item["text"] + "\nTopic:" + select(LABELS, name="label")
        return {"label": out["label"]}
    if kind == "tree":
        base = lm + TREE_PREAMBLE + "Question: " + item["question"] + "\n"
        thoughts, verdicts = [], []
        for i in range(cfg.branches):  # fork: guidance models are immutable values, so a branch is a copy
            branch = base + thought_cue(i) + gen("thought", max_tokens=cfg.thought_tokens, stop="\n",
                                                       temperature=0)
            branch += JUDGE + select(VERDICTS, name="verdict")
            thoughts.append(branch["thought"])
            verdicts.append(branch["verdict"])
        out = base + summary(thoughts, verdicts) + gen("answer", max_tokens=cfg.answer_tokens, stop="\n",
                                                       temperature=0)
        return {"thought": thoughts, "verdict": verdicts, "answer": out["answer"]}
    with system():
        lm += SYSTEM
    for t, message in enumerate(item["turns"]):
        with user():
            lm += message
        with assistant():
            lm += gen(f"reply{t}", max_tokens=cfg.reply_tokens, temperature=0)
    return {"replies": [lm[f"reply{t}"] for t in range(len(item["turns"]))]}


def run_guidance(cfg, workloads: dict) -> dict:
    import guidance
    import torch
    from guidance.chat import ChatMLTemplate  # SmolLM2's template is ChatML; guidance cannot parse its Jinja
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.threads)
    model_dir = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results = {}
    with legacy_cache_crop(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' past_key_values deprecation, once per forward
        # echo=False: no notebook display and no per-token probabilities, the fast setting for scripts.
        lm = guidance.models.Transformers(model, tokenizer, echo=False, chat_template=ChatMLTemplate)
        for kind, items in workloads.items():
            for item in warmup_items(items):
                guidance_program(kind, lm, cfg, item)
            # guidance's KV cache holds its last sequence; replace it with an unrelated one so that, like furcate
            # after flush_cache, the timed programs start with nothing cached.
            str(lm + "Unrelated." + guidance.gen(max_tokens=1, temperature=0))
            started = time.perf_counter()
            outputs = [guidance_program(kind, lm, cfg, item) for item in items]
            wall = time.perf_counter() - started
            results[kind] = {"wall_seconds": wall, "programs_per_s": len(items) / wall, "outputs": outputs}
    return results


# -- reporting ------------------------------------------------------------------------------------------------

def flat(outputs: list[dict]) -> list:
    return [v for out in outputs for value in out.values() for v in (value if isinstance(value, list) else [value])]


def agreement(one: list[dict], other: list[dict]) -> float:
    """Share of output values (labels, thoughts, verdicts, replies) that are identical on both sides."""
    pairs = list(zip(flat(one), flat(other)))
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else 0.0


def compare(kind: str, sides: dict) -> dict:
    row = {"programs": None}
    for name, result in sides.items():
        r = result[kind]
        row["programs"] = len(r["outputs"])
        row[name] = {k: v for k, v in r.items() if k != "outputs"}
    f = sides.get("F", {}).get(kind)
    for name in ("a", "b"):
        other = sides.get(name, {}).get(kind)
        if f and other:
            row[f"speedup_vs_{name}"] = other["wall_seconds"] / f["wall_seconds"]
            row[f"agreement_F_{name}"] = agreement(f["outputs"], other["outputs"])
    row["sample_outputs"] = {name: result[kind]["outputs"][0] for name, result in sides.items()}
    return row


AIMS = {"a": 3.0, "b": 5.0}  # the aim: F this many times faster on the select batch and the tree
COLUMNS = [("F s", "F", "wall_seconds", "{:.2f}"), ("F prog/s", "F", "programs_per_s", "{:.2f}"),
           ("a s", "a", "wall_seconds", "{:.2f}"), ("a prog/s", "a", "programs_per_s", "{:.2f}"),
           ("b s", "b", "wall_seconds", "{:.2f}"), ("b prog/s", "b", "programs_per_s", "{:.2f}"),
           ("F vs a", None, "speedup_vs_a", "{:.2f}x"), ("F vs b", None, "speedup_vs_b", "{:.2f}x"),
           ("F cache hit", "F", "cache_hit_rate", "{:.1%}"), ("same as F: a", None, "agreement_F_a", "{:.0%}"),
           ("same as F: b", None, "agreement_F_b", "{:.0%}")]


def table(rows: dict) -> list[str]:
    lines = ["| kind | programs | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for kind, row in rows.items():
        cells = [(row.get(side, {}) if side else row).get(key) for _, side, key, _ in COLUMNS]
        cells = ["-" if v is None else spec.format(v) for v, (_, _, _, spec) in zip(cells, COLUMNS)]
        lines.append(f"| {kind} | {row['programs']} | " + " | ".join(cells) + " |")
    return lines


def aims(rows: dict) -> list[str]:
    lines = []
    for kind in ("select", "tree"):
        for side, aim in AIMS.items():
            speedup = rows.get(kind, {}).get(f"speedup_vs_{side}")
            if speedup is not None:
                lines.append(f"aim F >= {aim:.0f}x over {side} on {kind}: {speedup:.2f}x, "
                             + ("met" if speedup >= aim else "NOT met"))
    return lines


def write_markdown(path: pathlib.Path, report: dict) -> None:
    idle = "NOT idle: treat the numbers as rough" if report["machine_busy"] else "idle"
    lines = [f"# Program benchmark ({report['date']})", "",
             f"Default model (SmolLM2-135M-Instruct), CPU, {report['config']['threads']} torch threads, greedy. "
             "F = furcate run_batch (radix cache on); a = sequential Engine.generate, radix cache off; b = guidance "
             "0.3.1 on HF transformers, sequential. Speedup = wall time of a or b / wall time of F.", "",
             f"Machine load (/proc/loadavg) before: {report['loadavg_before']}; after: {report['loadavg_after']}; "
             f"the machine was {idle}. Total run {report['total_seconds']:.0f} s.", "", *table(report["kinds"]), "",
             *[f"- {line}" for line in aims(report["kinds"])], "",
             f"Workload: `{json.dumps(report['config'])}`", "", f"guidance adapter: {report['guidance_adapter']}", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (few programs of each kind)")
    parser.add_argument("--kinds", default="select,tree,chat")
    parser.add_argument("--sides", default="F,a,b", help="F furcate, a plain Engine.generate, b guidance")
    parser.add_argument("--select-items", type=int, default=32)
    parser.add_argument("--tree-questions", type=int, default=8)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--thought-tokens", type=int, default=20)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--chat-convs", type=int, default=8)
    parser.add_argument("--chat-turns", type=int, default=3)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None,
                        help="JSON path, the .md goes next to it (default results/programs.json, or "
                             "results/programs_quick.json with --quick)")
    cfg = parser.parse_args()
    if cfg.quick:
        cfg.select_items, cfg.tree_questions, cfg.chat_convs = 4, 2, 2
    cfg.output = cfg.output or str(RESULTS / ("programs_quick.json" if cfg.quick else "programs.json"))
    kinds = [k for k in cfg.kinds.split(",") if k]
    sides = [s for s in cfg.sides.split(",") if s]
    builders = {"select": lambda: select_items(cfg.select_items), "tree": lambda: tree_items(cfg.tree_questions),
                "chat": lambda: chat_items(cfg.chat_convs, cfg.chat_turns)}
    workloads = {kind: builders[kind]() for kind in kinds}

    loadavg_before = pathlib.Path("/proc/loadavg").read_text().split()[:3]
    started = time.perf_counter()
    runners = {"F": run_furcate, "a": run_plain, "b": run_guidance}
    results = {}
    for side in sides:
        print(f"running side {side} ...", flush=True)
        results[side] = runners[side](cfg, workloads)
    loadavg_after = pathlib.Path("/proc/loadavg").read_text().split()[:3]

    rows = {kind: compare(kind, results) for kind in kinds}
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "config": vars(cfg),
              "loadavg_before": " ".join(loadavg_before), "loadavg_after": " ".join(loadavg_after),
              # busy: the 1-minute load average before the run (which itself adds about 2) was over 0.5
              "machine_busy": float(loadavg_before[0]) > 0.5, "total_seconds": time.perf_counter() - started,
              "guidance_adapter": " ".join(legacy_cache_crop.__doc__.split()), "kinds": rows}
    print("\n".join(table(rows) + aims(rows)))
    print(f"load before {report['loadavg_before']}, after {report['loadavg_after']}"
          + (" (machine NOT idle)" if report["machine_busy"] else "") + f"; total {report['total_seconds']:.0f}s")
    out = pathlib.Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    write_markdown(out.with_suffix(".md"), report)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
