"""Command line: `furcate prepare` converts the default model once; `furcate generate` runs a prompt."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="furcate")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="convert the embedded default model (GGUF) into the cache folder")
    generate = commands.add_parser("generate", help="generate from a prompt on a local engine")
    generate.add_argument("prompt")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    from .runtime.config import EngineArgs

    EngineArgs.add_cli_args(generate)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        from .runtime.model.default_model import prepare_default_model

        print(prepare_default_model())
        return 0
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from .runtime.config import EngineArgs
    from .runtime.engine import Engine

    engine_args = EngineArgs.from_cli_args(args)
    with Engine(**vars(engine_args)) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                          add_generation_prompt=True)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        printed = 0
        for chunk in engine.generate(prompt, params, stream=True):
            sys.stdout.write(chunk["text"][printed:])
            sys.stdout.flush()
            printed = len(chunk["text"])
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
