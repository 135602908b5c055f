"""Offline throughput: the same greedy workload through furcate and through HF transformers' batched generate.

Both systems get identical token ids, the same weights, the same torch thread count and generate exactly the
requested number of tokens per request (EOS never stops them). Only requested output tokens count as useful,
so HF's static batches pay for the padding and the surplus tokens their shared max_new_tokens forces.

    python -m benchmarks.offline_throughput [--num-prompts 64] [--hf-batch-size 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import pathlib
import random
import time
from dataclasses import asdict, dataclass

import torch

WORDS = ("river stone garden signal market ladder window copper silent orange engine winter harbor pencil cloud "
         "forest matter bridge candle number planet velvet thunder basket mirror shadow spring anchor meadow "
         "lantern rocket canyon violin marble desert island feather saddle crystal tunnel").split()
INSTRUCTIONS = ("Summarize these notes:", "Write a short story using these words:", "Sort these words into groups:",
                "Explain what connects these words:", "Translate these words into French:")
CHECKED_PROMPTS = 4  # the first prompts whose furcate tokens are compared with HF's


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    wall_seconds: float
    output_tok_s: float
    total_tok_s: float
    foreign_cpu_seconds: float  # CPU time other processes took meanwhile

    @property
    def disturbed(self) -> bool:
        """Other processes took over 5% of the run's CPU; with every core in use by torch threads, that much
        already slows a run several times (threads wait at every parallel region for a descheduled peer)."""
        return self.foreign_cpu_seconds > 0.05 * self.wall_seconds * (os.cpu_count() or 1)


def machine_busy_seconds() -> float:
    """CPU seconds used since boot by all processes plus hypervisor steal (/proc/stat: user..steal, not guest)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_pids() -> list[int]:
    """This process and its descendants (furcate's scheduler process; vLLM's engine core and, under it, its
    worker, which a children-only list would count as another process's load)."""
    pids, index = [os.getpid()], 0
    while index < len(pids):
        for path in glob.glob(f"/proc/{pids[index]}/task/*/children"):
            try:
                pids += [int(pid) for pid in pathlib.Path(path).read_text().split()]
            except OSError:  # the process or thread ended meanwhile
                pass
        index += 1
    return pids


class CpuMeter:
    """How much CPU processes other than ours used since creation.

    The benchmark runs on shared machines, where a concurrent job silently skews either system's number.
    """

    def __init__(self) -> None:
        self.pids = own_pids()
        self.started = self._sample()

    def _sample(self) -> tuple[float, float]:
        return machine_busy_seconds(), sum(process_cpu_seconds(pid) for pid in self.pids)

    def foreign_seconds(self) -> float:
        busy, ours = self._sample()
        return max(0.0, (busy - self.started[0]) - (ours - self.started[1]))


def chat_ids(tokenizer, words: list[str], instruction: str) -> list[int]:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"{instruction} {' '.join(words)}"}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def build_prompt(tokenizer, rng: random.Random, target_len: int) -> list[int]:
    """Chat prompt of about target_len tokens: the most random words that keep it within the target."""
    instruction, pool = rng.choice(INSTRUCTIONS), [rng.choice(WORDS) for _ in range(target_len)]
    low, high = 0, len(pool)
    while low < high:  # binary search, since one word can be several tokens
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(chat_ids(tokenizer, pool[:mid], instruction)) <= target_len else (low, mid - 1)
    return chat_ids(tokenizer, pool[:low], instruction)


def build_workload(tokenizer, num_prompts: int, seed: int, prompt_range: tuple[int, int],
                   output_range: tuple[int, int]) -> Workload:
    rng = random.Random(seed)
    prompts = [build_prompt(tokenizer, rng, rng.randint(*prompt_range)) for _ in range(num_prompts)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_prompts)])


def throughput(workload: Workload, seconds: float, foreign_cpu_seconds: float) -> Result:
    total_tokens = workload.prompt_tokens + workload.output_tokens
    return Result(seconds, workload.output_tokens / seconds, total_tokens / seconds, foreign_cpu_seconds)


def run_furcate(workload: Workload, model_dir: str, threads: int,
                engine_args: dict) -> tuple[Result, dict, list[list[int]]]:
    """Returns the result, scheduler facts (forward share of wall time, prompt tokens served from the prefix
    cache) and every request's tokens."""
    from furcate.runtime.engine.engine import Engine

    with Engine(model_dir, torch_num_threads=threads, **engine_args) as engine:
        engine.generate(input_ids=workload.prompts[:2], sampling_params={"max_new_tokens": 4, "temperature": 0})
        # The warm-up prompts must not be served from the prefix cache in the timed run.
        assert engine.flush_cache(), "furcate refused to flush its prefix cache"
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in workload.output_lens]
        before = engine.get_stats()
        meter, started = CpuMeter(), time.perf_counter()
        outputs = engine.generate(input_ids=workload.prompts, sampling_params=params)
        seconds, foreign = time.perf_counter() - started, meter.foreign_seconds()
        after = engine.get_stats()
    tokens = [out["output_ids"] for out in outputs]
    assert [len(t) for t in tokens] == workload.output_lens, "furcate did not honour max_new_tokens"
    facts = {"forward_share": (after["forward_seconds"] - before["forward_seconds"]) / seconds,
             "cached_prompt_tokens": after["cached_tokens_total"] - before["cached_tokens_total"]}
    return throughput(workload, seconds, foreign), facts, tokens


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> list[list[int]]:
    """One static batch, left padded; returns each row's generated tokens."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    # eos_token_id=None rather than min_new_tokens: min_new_tokens masks EOS out of the logits, which would
    # change greedy tokens, whereas furcate's ignore_eos keeps generating through an EOS like this does.
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    return out[:, width:].tolist()


def run_hf(workload: Workload, model_dir: str, batch_size: int) -> tuple[Result, list[list[int]]]:
    """Batches in input order, each generating its longest request's length; returns each request's tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = model.generation_config.pad_token_id
    tokens: list[list[int]] = []
    with torch.inference_mode():
        hf_generate(model, workload.prompts[:2], 4, pad_id)
        meter, started = CpuMeter(), time.perf_counter()
        for start in range(0, len(workload.prompts), batch_size):
            lens = workload.output_lens[start : start + batch_size]
            rows = hf_generate(model, workload.prompts[start : start + batch_size], max(lens), pad_id)
            tokens.extend(row[:n] for row, n in zip(rows, lens))
        seconds, foreign = time.perf_counter() - started, meter.foreign_seconds()
    return throughput(workload, seconds, foreign), tokens


def print_table(furcate: Result, hf: Result | None, facts: dict) -> None:
    print(f"{'system':<10}{'wall s':>10}{'output tok/s':>15}{'total tok/s':>15}{'foreign cpu s':>15}")
    for name, r in (("furcate", furcate), ("hf", hf)):
        if r is not None:
            print(f"{name:<10}{r.wall_seconds:>10.2f}{r.output_tok_s:>15.1f}{r.total_tok_s:>15.1f}"
                  f"{r.foreign_cpu_seconds:>15.1f}")
    for name, r in (("furcate", furcate), ("hf", hf)):
        if r is not None and r.disturbed:
            print(f"WARNING: other processes used {r.foreign_cpu_seconds:.0f} CPU-s during the {name} run; "
                  "its numbers are not trustworthy")
    if hf is not None:
        print(f"furcate / hf output tok/s: {furcate.output_tok_s / hf.output_tok_s:.2f}x")
    print(f"furcate wall time in model forward: {facts['forward_share']:.1%}; "
          f"prompt tokens from its prefix cache: {facts['cached_prompt_tokens']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt-len", type=int, default=20)
    parser.add_argument("--max-prompt-len", type=int, default=400)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    # 16 keeps HF's padding and surplus-token waste moderate while still batching its matmuls.
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both systems")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help='extra furcate engine arguments as JSON, e.g. \'{"disable_overlap_schedule": true}\'')
    parser.add_argument("--output", default=str(pathlib.Path(__file__).parent / "results" / "offline_throughput.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from furcate.runtime.model.weights.default_model import prepare_default_model

    torch.set_num_threads(args.threads)
    model_dir = str(prepare_default_model())
    workload = build_workload(AutoTokenizer.from_pretrained(model_dir), args.num_prompts, args.seed,
                              (args.min_prompt_len, args.max_prompt_len), (args.min_output_len, args.max_output_len))
    print(f"{args.num_prompts} prompts: {workload.prompt_tokens} prompt tokens, {workload.output_tokens} output "
          f"tokens, torch threads {args.threads}")
    furcate, facts, furcate_tokens = run_furcate(workload, model_dir, args.threads, args.engine_args)
    hf, matched = None, None
    if not args.skip_hf:
        hf, hf_tokens = run_hf(workload, model_dir, args.hf_batch_size)
        checked = min(CHECKED_PROMPTS, args.num_prompts)
        matched = sum(furcate_tokens[i] == hf_tokens[i] for i in range(checked))
        print(f"greedy tokens identical to HF for {matched}/{checked} of the first prompts")
    print_table(furcate, hf, facts)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": model_dir,
        "torch_threads": args.threads,
        "torch_version": torch.__version__,
        "workload": {**{k: v for k, v in vars(args).items() if k not in ("skip_hf", "output", "threads")},
                     "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens},
        "furcate": asdict(furcate) | facts | {"disturbed": furcate.disturbed},
        "hf": asdict(hf) | {"disturbed": hf.disturbed} if hf else None,
        "ratio_output_tok_s": furcate.output_tok_s / hf.output_tok_s if hf else None,
        "matched_first_prompts": matched,
    }
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
